"""The fused MoE (``_torch/modules/fused_moe``) against its torch reference, on awkward sizes and
skewed routing; under Triton's interpreter on a CPU, compiled on a GPU."""

import pytest
import torch

pytest.importorskip("triton.language")

from tensorrt_llm._torch.modules.fp8.block import quantize_weight  # noqa: E402
from tensorrt_llm._torch.modules.fused_moe.align import align_by_expert, max_blocks  # noqa: E402
from tensorrt_llm._torch.modules.fused_moe.ops import fused_experts  # noqa: E402
from tensorrt_llm._torch.modules.gated_mlp import SwigluOai  # noqa: E402
from tensorrt_llm._torch.modules.moe import reference_experts, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GLU = SwigluOai(alpha=1.702, limit=7.0)


def test_slots_are_sorted_by_expert_in_runs_padded_to_the_block():
    ids = torch.tensor([[5, 2], [5, 0], [5, 7]])  # slots 0..5: experts 5 2 5 0 5 7
    blocks = align_by_expert(ids, num_experts=8, block_m=2)
    S = 6  # padding: num_slots
    assert blocks.sorted_slots.tolist() == [3, S, 1, S, 0, 2, 4, S, 5, S, S, S]
    assert blocks.block_expert.tolist() == [0, 2, 5, 5, 7, -1]
    assert blocks.num_blocks == max_blocks(6, 8, 2) == 6


def test_the_block_count_depends_on_the_token_count_only():
    skewed = torch.tensor([[1, 2]] * 9)
    spread = torch.arange(18).view(9, 2) % 16
    a, b = align_by_expert(skewed, 16, 16), align_by_expert(spread, 16, 16)
    assert a.num_blocks == b.num_blocks == max_blocks(18, 16, 16)
    assert (a.block_expert >= 0).sum() == 2 and (b.block_expert >= 0).sum() == 16


def test_another_ranks_experts_are_in_no_run():
    ids = torch.tensor([[1, -1], [-1, -1], [0, 1]])  # -1: an expert another rank holds (EP)
    blocks = align_by_expert(ids, num_experts=2, block_m=2)
    S = 6
    assert blocks.sorted_slots.tolist() == [4, S, 0, 5] + [S] * 4
    assert blocks.block_expert.tolist() == [0, 1, -1, -1]


def make_case(num_tokens, hidden, inter, num_experts, top_k, dtype, seed, skew=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5 * 3
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    bias = torch.randn(num_experts, generator=g) * 0.1
    if skew == "one expert":  # every token's first choice is expert 3
        bias[3] = 100.0
    elif skew == "two experts":  # all to 1 and 4, the rest empty
        bias[1] = bias[4] = 100.0
    weights, ids = route(logits, bias, top_k)
    cast = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    return cast(x), cast(w13), cast(w2), weights.to(DEVICE), ids.to(DEVICE)


def check(case, dtype):
    x, w13, w2, weights, ids = case
    got = fused_experts(x, w13, w2, weights, ids, GLU)
    if dtype == torch.float32:
        want = reference_experts(x, w13, w2, weights, ids, GLU)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # the kernels keep gate, up and the down product in fp32; so does this oracle
        f = lambda t: t.float()  # noqa: E731
        want = reference_experts(f(x), f(w13), f(w2), weights, ids, GLU)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert got.dtype == torch.float32 and got.shape == x.shape


@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k",
    [(1, 64, 64, 8, 2), (17, 48, 40, 8, 2), (5, 96, 72, 16, 4), (130, 32, 24, 4, 2)],
    ids=["decode", "awkward", "top4", "many-per-expert"],
)
def test_fused_experts_match_the_reference(num_tokens, hidden, inter, num_experts, top_k):
    case = make_case(num_tokens, hidden, inter, num_experts, top_k, torch.float32, seed=num_tokens)
    check(case, torch.float32)


@pytest.mark.parametrize("skew", ["one expert", "two experts"])
def test_skewed_routing_and_empty_experts(skew):
    case = make_case(33, 64, 40, 8, 2, torch.float32, seed=7, skew=skew)
    ids = case[4].cpu()
    if skew == "one expert":
        assert (ids == 3).any(dim=1).all()
    else:
        assert set(ids.flatten().tolist()) == {1, 4}
    check(case, torch.float32)


def test_a_ranks_share_under_expert_parallelism():
    """Experts 0-3 of 8 held here, the slots of 4-7 marked -1: the reference's sum over experts
    0-3 alone."""
    x, w13, w2, weights, ids = make_case(21, 64, 40, 8, 2, torch.float32, seed=5)
    local = torch.where(ids < 4, ids, -1)
    assert (local < 0).any() and (local >= 0).any()
    got = fused_experts(x, w13[:4], w2[:4], weights, local, GLU)
    want = reference_experts(x, w13, w2, torch.where(ids < 4, weights, 0.0), ids, GLU)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bf16_inputs():
    check(make_case(9, 64, 48, 8, 2, torch.bfloat16, seed=3), torch.bfloat16)


def test_no_tokens():
    x, w13, w2, weights, ids = make_case(1, 32, 16, 4, 2, torch.float32, seed=0)
    out = fused_experts(x[:0], w13, w2, weights[:0], ids[:0], GLU)
    assert out.shape == (0, 32)


def test_mismatched_weights_are_refused():
    x, w13, w2, weights, ids = make_case(2, 32, 16, 4, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"w13 \(4, 32, 32\) and w2 \(4, 16, 32\)"):
        fused_experts(x, w13, w2.transpose(1, 2), weights, ids, GLU)


def quantize_experts(w13, w2):
    """Each expert's gate, up and down weights block-quantized, scales in ``StackedExperts``'s
    layout (the gate rows' blocks, then the up rows')."""
    inter = w13.shape[1] // 2
    parts = [
        [quantize_weight(w[e, :inter].cpu()), quantize_weight(w[e, inter:].cpu())] for e, w in
        ((e, w13) for e in range(w13.shape[0]))
    ]  # fmt: skip
    q13 = torch.stack([torch.cat([g[0], u[0]]) for g, u in parts]).to(DEVICE)
    s13 = torch.stack([torch.cat([g[1], u[1]]) for g, u in parts]).to(DEVICE)
    down = [quantize_weight(w2[e].cpu()) for e in range(w2.shape[0])]
    q2 = torch.stack([q for q, _ in down]).to(DEVICE)
    s2 = torch.stack([s for _, s in down]).to(DEVICE)
    return q13, s13, q2, s2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens, hidden, inter, skew",
    [(1, 200, 72, None), (21, 256, 160, None), (19, 130, 200, "one expert")],
    ids=["decode-awkward", "batch", "skewed"],
)
def test_fp8_experts_match_the_fp8_reference(num_tokens, hidden, inter, skew, dtype):
    x, w13, w2, weights, ids = make_case(
        num_tokens, hidden, inter, 8, 2, dtype, seed=hidden, skew=skew
    )
    q13, s13, q2, s2 = quantize_experts(w13.float(), w2.float())
    got = fused_experts(x, q13, q2, weights, ids, GLU, s13, s2)
    if dtype == torch.float32:  # on a GPU, FP8 tensor cores sum each 128-channel step to ~14 bits
        want = reference_experts(x, q13, q2, weights, ids, GLU, s13, s2)
        tol = 1e-4 if DEVICE == "cpu" else 5e-3
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    else:  # bf16 rounding before the on-the-fly quantization moves some values by a float8 step
        want = reference_experts(x.float(), q13, q2, weights, ids, GLU, s13, s2)
        assert (got - want).norm() <= 5e-2 * want.norm()
    # and within FP8's error of the unquantized experts
    exact = reference_experts(x.float(), w13.float(), w2.float(), weights, ids, GLU)
    assert (got - exact).norm() <= 0.1 * exact.norm()


def test_fp8_needs_both_scales():
    x, w13, w2, weights, ids = make_case(2, 128, 128, 4, 2, torch.float32, seed=0)
    q13, s13, q2, _ = quantize_experts(w13, w2)
    with pytest.raises(ValueError, match="FP8 needs float8_e4m3fn w13 and w2 and both scales"):
        fused_experts(x, q13, q2, weights, ids, GLU, s13, None)
