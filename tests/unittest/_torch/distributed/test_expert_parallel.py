"""Expert parallelism and MoE tensor parallelism on the CPU, over gloo, on a tiny published-
architecture MiniMax-M3 in fp32 with 8 experts: each layout decodes one rank's greedy tokens, with
logprobs within 1e-4, target only and with Eagle3 (unified draft cache).

- ``tp2-ep2``: tensor-parallel attention, each rank 4 whole experts, one all-reduce of the shares;
- ``adp2-ep2``: attention DP, each rank's tokens sent to the rank holding their experts and back
  (all-to-all, sized by the counts or through fixed buffers), a rank without tokens in a step
  taking part all the same;
- ``tp2-moetp2``: tensor-parallel attention, each rank half of every expert's intermediate.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.24")

from tensorrt_llm import LLM, SamplingParams  # noqa: E402
from tensorrt_llm._torch.models.checkpoint import random_eagle3, save_pretrained  # noqa: E402
from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config  # noqa: E402
from tensorrt_llm.llmapi.llm_args import (  # noqa: E402
    Eagle3DecodingConfig,
    KvCacheConfig,
    TorchLlmArgs,
)

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
LAYOUTS = {
    "tp2-ep2": dict(tensor_parallel_size=2, moe_expert_parallel_size=2),
    # a batch of 4: steps of at most 4 x (1 + drafts) tokens on every rank exchange through the
    # fixed buffers (a CUDA graph's), the prefills through buffers sized by the counts
    "adp2-ep2": dict(
        tensor_parallel_size=2,
        enable_attention_dp=True,
        moe_expert_parallel_size=2,
        max_batch_size=4,
    ),
    "tp2-moetp2": dict(tensor_parallel_size=2, moe_tensor_parallel_size=2),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random published M3 (transformers' layout) with MoE layers of 8 experts (top-2, a
    nonzero score-correction bias), and a random Eagle3 drafter beside it."""
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    full, sparse = "full_attention", "minimax_m3_sparse"
    config = MiniMaxM3VLTextConfig(
        vocab_size=98,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        dense_intermediate_size=48,
        shared_intermediate_size=24,
        num_local_experts=8,
        num_experts_per_tok=2,
        layer_types=[full, sparse, full, sparse],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=8,
        index_topk_blocks=2,
        index_local_blocks=1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = MiniMaxM3VLForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                torch.randn(param.shape, generator=generator) * (0.3 if "norm" in name else 0.08)
            )
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)
    root = tmp_path_factory.mktemp("m3-8-experts")
    model.save_pretrained(root / "target")
    draft = Eagle3Config.from_dict(
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 98,
            "draft_vocab_size": 98,
            "target_hidden_size": 64,
        }
    )
    save_pretrained(random_eagle3(draft, layer_idx=4, seed=3, std=0.1), draft, root / "eagle3")
    return root


def prompts() -> list[list[int]]:
    """Six prompts: under attention DP each rank gets some, and ranks run steps without any."""
    generator = torch.Generator().manual_seed(11)
    return [
        torch.randint(2, 98, (n,), generator=generator).tolist() for n in (5, 23, 41, 9, 60, 17)
    ]


def rank0_experts(llm: LLM) -> list:
    executor = getattr(llm.executor, "local", llm.executor)  # attention DP: rank 0's own
    return [
        m for m in executor.model_engine.model.modules() if type(m).__name__ == "StackedExperts"
    ]


def decode(
    model_dir, mode: str | None, check=None, **parallel
) -> tuple[list[tuple[list[int], list[float]]], list[int]]:
    spec = None
    if mode is not None:
        spec = Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(model_dir / "eagle3"), draft_kv_cache=mode
        )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(
        model_dir / "target",
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=2048),
        speculative_config=spec,
        **parallel,
    ) as llm:
        outputs = llm.generate(prompts(), params)
        if check is not None:
            check(llm)
        routed = llm.get_stats()["expert_tokens"]  # every rank's tokens, per expert
    completions = [o.outputs[0] for o in outputs]
    return [(c.token_ids, [lp for lp, _ in c.logprobs]) for c in completions], routed


@pytest.fixture(scope="module")
def one_rank(model_dir) -> dict:
    return {mode: decode(model_dir, mode) for mode in (None, "unified")}


@pytest.mark.parametrize("mode", [None, "unified"], ids=["target", "eagle3"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_decodes_as_one_rank(model_dir, one_rank, layout, mode):
    def check(llm):
        experts = rank0_experts(llm)
        assert len(experts) == 3  # the three MoE layers
        ep = LAYOUTS[layout].get("moe_expert_parallel_size", 1)
        for e in experts:  # rank 0 holds its share only
            assert (e.w13.shape[0], e.expert_start, e.local_intermediate) == (
                8 // ep,
                0,
                32 // (2 // ep),
            )
        if "enable_attention_dp" in LAYOUTS[layout]:
            stats, local = llm.executor.stats, llm.executor.local.stats
            assert 0 < local.num_generated_tokens < stats.num_generated_tokens  # both ranks ran
            assert local.num_idle_steps > 0  # steps rank 0 took part in without tokens

    got, routed = decode(model_dir, mode, check, **LAYOUTS[layout])
    want, one_rank_routed = one_rank[mode]
    # the same tokens went through the same routing: each expert took as many as on one rank
    assert routed == one_rank_routed and len(routed) == 8 and sum(routed) > 0
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    worst = max(
        abs(a - b)
        for (_, mine), (_, theirs) in zip(got, want, strict=True)
        for a, b in zip(mine, theirs, strict=True)
    )
    assert worst <= 1e-4, f"{layout}: logprobs off by {worst:.2e}"


def test_a_layout_that_cannot_be_served_fails_before_any_rank_starts(model_dir, tmp_path):
    with pytest.raises(ValueError, match="moe_expert_parallel_size=4 does not divide tensor_par"):
        LLM(model_dir / "target", device="cpu", tensor_parallel_size=2, moe_expert_parallel_size=4)
    options = tmp_path / "adp_moe_tp.yaml"
    options.write_text(
        "tensor_parallel_size: 2\nenable_attention_dp: true\nmoe_tensor_parallel_size: 2\n"
    )
    with pytest.raises(ValueError, match="set moe_expert_parallel_size=2"):
        TorchLlmArgs.from_kwargs(extra_llm_api_options=options, model="m")


def test_the_load_figures_histogram_each_ranks_experts_and_compare_the_busiest_rank():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tensorrt_llm.serve.metrics import moe_load

    class Collector:
        def collect(self):
            yield from moe_load([10, 0, 5, 5, 20, 4, 4, 4], ep_size=2)  # mean expert 6.5

    registry = CollectorRegistry()
    registry.register(Collector())
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples[("trtllm_moe_expert_tokens_total", (("expert", "4"), ("rank", "1")))] == 20
    bucket = "trtllm_moe_expert_load_bucket"
    # rank 0's experts at 10, 0, 5, 5 tokens: 1.54, 0, 0.77, 0.77 of the mean
    assert samples[(bucket, (("le", "0.25"), ("rank", "0")))] == 1
    assert samples[(bucket, (("le", "0.9"), ("rank", "0")))] == 3
    assert samples[(bucket, (("le", "2.0"), ("rank", "0")))] == 4
    assert samples[(bucket, (("le", "+Inf"), ("rank", "1")))] == 4
    # ranks at 20 and 32 tokens: the busiest 32 / 26
    assert samples[("trtllm_moe_rank_imbalance", ())] == pytest.approx(32 / 26)


def _exchange_rank(rank: int, init: str, out: str) -> None:
    """One rank of ``test_the_fixed_exchange_gives_the_sized_ones_sums``."""
    import torch.distributed as dist

    from tensorrt_llm._torch.distributed.moe_all_to_all import (
        all_to_all_experts,
        all_to_all_fixed,
    )
    from tensorrt_llm._torch.modules.gated_mlp import SwigluOai
    from tensorrt_llm._torch.modules.moe import reference_experts, route

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(0)
    w13 = torch.randn(8, 2 * 16, 32, generator=generator) * 0.1
    w2 = torch.randn(8, 32, 16, generator=generator) * 0.1
    glu = SwigluOai()
    tokens = (5, 0)[rank]  # rank 1 has no tokens: it still runs rank 0's on its experts
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(rank + 1))
    weights, ids = route(x @ torch.randn(32, 8, generator=generator), torch.zeros(8), 2)
    mine = slice(4 * rank, 4 * rank + 4)

    def compute(rx, rw, rids):
        return reference_experts(rx, w13[mine], w2[mine], rw, rids, glu)

    sized = all_to_all_experts(x, weights, ids, 4, 2, compute)
    fixed = all_to_all_fixed(x, weights, ids, 4, 2, compute, capacity=6)
    whole = reference_experts(x, w13, w2, weights, ids, glu)
    torch.save({"sized": sized, "fixed": fixed, "whole": whole}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_the_fixed_exchange_gives_the_sized_ones_sums(tmp_path):
    """Two ranks over gloo, 4 experts each: the exchange sized by the counts, the one of fixed
    buffers (a CUDA graph's) and one rank holding all 8 experts give the same bits."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'init'}"
    mp.spawn(_exchange_rank, args=(init, str(tmp_path / "out")), nprocs=2)
    rank0 = torch.load(tmp_path / "out.0")
    assert rank0["sized"].shape == (5, 32) and rank0["sized"].abs().sum() > 0
    assert torch.equal(rank0["sized"], rank0["whole"])
    assert torch.equal(rank0["fixed"], rank0["whole"])
    assert torch.load(tmp_path / "out.1")["sized"].shape == (0, 32)


def test_the_ranks_agree_on_each_steps_exchange(monkeypatch):
    """``plan_step`` with ``ExchangeSync`` and the ranks' all-reduce stubbed: fixed buffers (and
    the CUDA graphs, all captured at start-up) when no rank has more tokens than they hold, else
    every rank runs eagerly, sized by the counts; one collective per step, also on a rank with
    nothing to run, which makes one pass without tokens; a plan made again after requests were
    paused keeps the agreement without a second collective."""
    from types import SimpleNamespace

    from tensorrt_llm._torch.distributed import moe_all_to_all
    from tensorrt_llm._torch.pyexecutor.mixed_bucket import GraphShape
    from tensorrt_llm._torch.pyexecutor.step_plan import plan_step

    passes, sent = [], []
    block = SimpleNamespace(idle=passes.append)  # records the capacity of each idle pass
    sync = moe_all_to_all.ExchangeSync([block], capacity=8)
    runner = SimpleNamespace(shape_of=lambda batch: GraphShape(2), tokens_per_seq=4)
    decode = SimpleNamespace(batch_size=2, num_tokens=8)  # (two rows of 1 + 3 drafts)
    nothing = SimpleNamespace(batch_size=0, num_tokens=0)
    others = {"tokens": 0}

    def max_over_ranks(values):
        sent.append(values)
        return [max(values[0], others["tokens"])]

    monkeypatch.setattr(moe_all_to_all, "max_over_ranks", max_over_ranks)
    plan = plan_step(decode, runner, sync)
    assert sent[-1] == [8]  # bucket 2 x 4 rows
    assert (plan.bucket, plan.moe_capacity) == (GraphShape(2), 8)
    others["tokens"] = 9  # a rank's prefill overflows the fixed rows
    plan = plan_step(decode, runner, sync)
    assert (plan.bucket, plan.moe_capacity) == (None, None)  # eager, sized by the counts
    again = plan_step(decode, runner, sync, agreed=plan)
    assert len(sent) == 2 and (again.bucket, again.moe_capacity) == (None, None)
    others["tokens"] = 0
    idle = plan_step(nothing, runner, sync)  # nothing to run here
    assert idle.idle and idle.bucket is None
    sync.idle_step(idle.moe_capacity)
    assert sent[-1] == [0] and passes == [8]
