"""Top-p sampling by rejection against a rising pivot (``nucleus.py``): the Triton program (under
the interpreter on the CPU) draws the torch form's tokens, and the tokens follow the top-p
distribution a sort defines (``sampler.filtered_probs``)."""

import pytest
import torch

from tensorrt_llm._torch.pyexecutor import nucleus
from tensorrt_llm._torch.pyexecutor.nucleus import (
    nucleus_kernel_sample,
    nucleus_torch,
    row_logprobs,
)
from tensorrt_llm._torch.pyexecutor.sampler import (
    COUNTER_STRIDE,
    LANE_TOKEN,
    SamplingTensors,
    filtered_probs,
    sample,
    uniform,
)


def batch(n: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 3
    temperature = torch.rand(n, generator=gen) + 0.3
    temperature[::7] = 0.0  # greedy rows
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.05
    top_p[::5] = 1.0
    top_p[3] = 1e-4  # the first token alone: rejections until the pivot reaches the top
    return logits, temperature, top_p


def on_device() -> torch.device:
    """CUDA where there is one; else the CPU, the kernels under Triton's interpreter."""
    pytest.importorskip("triton.language")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("fast_rounds", [0, 1, nucleus.FAST_ROUNDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_programs_draw_the_torch_forms_tokens(dtype, fast_rounds, monkeypatch):
    """Every round split over pieces, none (one program walks each row), or some of each."""
    device = on_device()
    monkeypatch.setattr(nucleus, "FAST_ROUNDS", fast_rounds)
    logits, temperature, top_p = (t.to(device) for t in batch(48, 5000))  # a partial piece
    logits = logits.to(dtype)
    seed = torch.arange(48, device=device) * 7919 + 3
    counter = torch.full((48,), 5 * COUNTER_STRIDE, device=device)
    # the kernels hash the torch form's numbers: round r on lane LANE_TOKEN + r * LANE_STRIDE
    lanes = torch.arange(nucleus.ROUNDS, device=device) * nucleus.LANE_STRIDE + LANE_TOKEN
    u = uniform(seed[:, None], counter[:, None], lanes)
    want = nucleus_torch(logits, temperature, top_p, u)
    got = nucleus_kernel_sample(logits, temperature, top_p, seed, counter, LANE_TOKEN)
    assert got.tolist() == want.tolist()
    greedy = temperature == 0
    assert (got[greedy] == logits[greedy].float().argmax(dim=-1)).all()
    assert got[3] == logits[3].float().argmax()


def test_the_rounds_end_at_a_kept_token():
    logits, temperature, top_p = batch(200, 300, seed=1)
    u = torch.rand(200, nucleus.ROUNDS, generator=torch.Generator().manual_seed(5))
    tokens = nucleus_torch(logits, temperature, top_p, u)
    kept = filtered_probs(logits, rows(temperature, top_p)) > 0
    assert kept.gather(1, tokens[:, None]).all()


def rows(temperature: torch.Tensor, top_p: torch.Tensor) -> SamplingTensors:
    n = temperature.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    return SamplingTensors(temperature, zeros, top_p, zeros, zeros, False, uses_top_k=False)


@pytest.mark.parametrize("top_p", [1.0, 0.8, 0.3])
def test_tokens_follow_the_top_p_distribution(top_p):
    n = 20000  # seeds: 3 sigma of a frequency is at most 0.011
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]]).expand(n, -1)
    st = SamplingTensors(
        torch.full((n,), 0.8),
        torch.zeros(n, dtype=torch.long),
        torch.full((n,), top_p),
        torch.arange(n, dtype=torch.long) * 7919 + 1,
        torch.zeros(n, dtype=torch.long),
        all_greedy=False,
        uses_top_k=False,
    )
    frequency = torch.bincount(sample(logits, st), minlength=8) / n
    torch.testing.assert_close(frequency, filtered_probs(logits[:1], st.select(slice(0, 1)))[0],
                               atol=0.011, rtol=0)  # fmt: skip


def test_the_log_sum_exp_and_top_logits_of_the_pieces():
    device = on_device()
    logits = (torch.randn(5, 5000, generator=torch.Generator().manual_seed(2)) * 4).to(device)
    for dtype in (torch.float32, torch.bfloat16):  # (bf16 rows have ties: the ids are checked
        rows = logits.to(dtype)  # to hold the top values, not to be torch's choice among equals)
        want = torch.logsumexp(rows.float(), dim=-1)
        want_values = rows.float().topk(3, dim=-1).values
        got = nucleus._row_stats(rows, torch.ones(5, device=device), 3)
        torch.testing.assert_close(got[0] + got[3].log(), want)
        assert (rows.float().gather(1, got[1][:, None])[:, 0] == want_values[:, 0]).all()
        lse, values, ids = row_logprobs(rows, 3)
        torch.testing.assert_close(lse, want)
        assert values.tolist() == want_values.tolist()
        assert rows.float().gather(1, ids).tolist() == want_values.tolist()
        assert all(len(set(row)) == 3 for row in ids.tolist())


def test_rows_that_are_not_finite_give_a_token_in_the_vocabulary():
    device = on_device()
    logits = torch.randn(4, 5000, device=device)
    logits[0] = float("nan")
    logits[1, 7] = float("inf")
    logits[2, ::2] = float("-inf")
    temperature, top_p = torch.full((4,), 0.8, device=device), torch.full((4,), 0.9, device=device)
    seed, counter = torch.arange(4, device=device), torch.zeros(4, dtype=torch.long, device=device)
    got = nucleus_kernel_sample(logits, temperature, top_p, seed, counter, LANE_TOKEN)
    u = uniform(seed[:, None], counter[:, None], torch.arange(nucleus.ROUNDS, device=device))
    for tokens in (got, nucleus_torch(logits, temperature, top_p, u)):
        assert ((tokens >= 0) & (tokens < 5000)).all()
        assert tokens[2] % 2 == 1  # only the finite half has weight


def test_a_seeded_row_draws_the_same_token_whether_or_not_a_top_k_row_shares_its_batch():
    # (a row without a top-k draws by rejection even when another row of its batch makes the
    # batch sort: a seeded request's tokens are its own)
    n = 64
    logits = torch.randn(n, 50, generator=torch.Generator().manual_seed(3)) * 2
    st = SamplingTensors(
        torch.full((n,), 0.9),
        torch.zeros(n, dtype=torch.long),
        torch.full((n,), 0.95),
        torch.arange(n, dtype=torch.long) + 11,
        torch.full((n,), 3 * COUNTER_STRIDE, dtype=torch.long),
        all_greedy=False,
        uses_top_k=False,
    )
    alone = sample(logits, st)
    top_k = st.top_k.clone()
    top_k[::2] = 5  # every other row asks for a top-k
    mixed = SamplingTensors(st.temperature, top_k, st.top_p, st.seed, st.counter, False, True)
    together = sample(logits, mixed)
    assert torch.equal(together[1::2], alone[1::2])
    assert (top_k[::2, None] > logits[::2].argsort(-1, descending=True).argsort(-1).gather(
        1, together[::2, None])).all()  # fmt: skip
