"""Disaggregated serving between servers of several ranks, on the CPU (gloo, NIXL over UCX in
DRAM): a tensor-parallel context server feeds a generation server of another layout (one rank,
attention DP with the experts replicated or split by EP, tensor parallel), and a one-rank context server feeds a tensor-parallel one. Heads
are regrouped between the layouts; the replies equal an aggregated one-rank server's, the
generation side computes no prompt token, and no slot stays held on either side, also after a
burst of requests with hang-ups through a cache too small to leak in (every rank stays in step).
The TP2 -> attention-DP arm also runs the M3-shaped benchmark model (tiny widths, random weights,
fp32: the layouts then decode alike) on prompts long enough for MSA's sparse block selection."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tensorrt_llm.bundled import bundled_eagle3
from tensorrt_llm.evaluate.deployment import chat_many, disaggregated_deployment, metric, running

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow
OPTIONS = {
    "speculative_config": bundled_eagle3(),
    "kv_cache_config": {"max_tokens": 8192},
}
QUESTIONS = [
    "Ann has 58 cups. Ann gets 67 more cups. How many cups does Ann have now?",
    "Ben has 93 pens. Ben gives away 45 pens. How many pens does Ben have left?",
    "Remember this list: red moon 4821 fish gold. " * 12,  # three blocks of 128 tokens
]
CONVERSATIONS = [[{"role": "user", "content": q}] for q in QUESTIONS]
TP1, TP2, ADP2 = (
    {},
    {"tensor_parallel_size": 2},
    {"tensor_parallel_size": 2, "enable_attention_dp": True},
)
ADP2_EP2 = {**ADP2, "moe_expert_parallel_size": 2}  # the experts split, tokens by all-to-all


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    with running(tmp_path_factory.mktemp("agg")) as servers:
        servers.server("agg", OPTIONS)
        servers.wait_healthy()
        yield chat_many(servers.urls["agg"], CONVERSATIONS, max_tokens=48)


@pytest.mark.parametrize(
    "layouts",
    [(TP2, ADP2), (TP2, ADP2_EP2), (TP2, TP1), (TP1, TP2), (TP2, TP2)],
    ids=["tp2-to-adp2", "tp2-to-adp2-ep2", "tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2"],
)
def test_kv_crosses_between_parallel_layouts(layouts, expected, tmp_path):
    with disaggregated_deployment(OPTIONS, "cpu", tmp_path, layouts=layouts) as urls:
        replies = chat_many(urls["router"], CONVERSATIONS, max_tokens=48)
        assert [r["text"] for r in replies] == [r["text"] for r in expected]
        assert [r["al"] for r in replies] == pytest.approx([r["al"] for r in expected], abs=0.02)
        gen, ctx = urls["gen"], urls["ctx"]
        assert metric(gen, "trtllm_context_tokens_computed_total") == 0  # no prefill there
        assert metric(gen, "trtllm_transferred_tokens_total") > 0
        assert_nothing_held(ctx, gen)
    for name, layout in zip(("ctx", "gen"), layouts):
        assert_unified_on_every_rank((tmp_path / f"{name}.log").read_text(), layout)


def assert_unified_on_every_rank(log: str, layout: dict) -> None:
    """Every rank's process logged its unified draft KV layout (``[RANK r]`` once several)."""
    ranks = layout.get("tensor_parallel_size", 1)
    lines = [line for line in log.splitlines() if "[unified-kv] draft layers" in line]
    if ranks == 1:
        assert lines and all("[RANK" not in line for line in lines)
    for rank in range(ranks if ranks > 1 else 0):
        assert any(f"[RANK {rank}] [INFO] [unified-kv]" in line for line in lines), rank


def assert_nothing_held(ctx: str, gen: str) -> None:
    deadline = time.time() + 30
    while time.time() < deadline and metric(ctx, "trtllm_held_for_transfer"):
        time.sleep(0.2)  # released once pulled (on every context rank)
    for url in (ctx, gen):
        assert metric(url, "trtllm_held_for_transfer") == 0
        assert metric(url, 'trtllm_kv_cache_slots{state="used"}') == 0


def burst(router: str, count: int) -> list[str]:
    """``count`` requests, 8 at a time; every third hangs up after its first event."""

    def one(i: int) -> str:
        body = {
            "messages": [{"role": "user", "content": f"{QUESTIONS[i % 3]} ({i})"}],
            "max_tokens": 64,
            "stream": i % 3 == 0,
            "ignore_eos": True,
        }
        if i % 3:
            reply = httpx.post(router + "/v1/chat/completions", json=body, timeout=300)
            reply.raise_for_status()
            return "answered"
        with httpx.stream("POST", router + "/v1/chat/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                break
        return "hung up"

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


@pytest.mark.parametrize(
    "layouts",
    [(TP2, TP2), (TP2, ADP2), (TP2, ADP2_EP2)],
    ids=["tp2-to-tp2", "tp2-to-adp2", "tp2-to-adp2-ep2"],
)
def test_a_burst_with_hang_ups_leaves_every_rank_in_step(layouts, expected, tmp_path):
    # 16 slots of 128 tokens per rank: a hold or a pull left behind on any rank would soon starve
    # that rank, and its allocations (so its steps) would part from rank 0's
    small = {**OPTIONS, "kv_cache_config": {"max_tokens": 2048}}
    with disaggregated_deployment(small, "cpu", tmp_path, layouts=layouts) as urls:
        assert sorted(set(burst(urls["router"], 36))) == ["answered", "hung up"]
        assert_nothing_held(urls["ctx"], urls["gen"])
        replies = chat_many(urls["router"], CONVERSATIONS, max_tokens=48)
        assert [r["text"] for r in replies] == [r["text"] for r in expected]
        assert_nothing_held(urls["ctx"], urls["gen"])


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def benchmark_model(tmp_path_factory) -> dict:
    """The benchmark model at tiny widths (8 layers, 6 of them MSA with top-2 blocks), and its
    drafter: the options of a server of it."""
    sys.path.insert(0, str(BENCHMARKS))
    from bench_decode import Settings, write_checkpoints

    settings = Settings("tiny", "cpu", "float32", "VANILLA", False, 400, 16, 3, 8192, 10.0, 0)
    target, draft = write_checkpoints(tmp_path_factory.mktemp("benchmark_model"), settings)
    return {
        "model": str(target),
        "speculative_config": {**bundled_eagle3(), "speculative_model": str(draft)},
        "kv_cache_config": {"max_tokens": 8192},
    }


def completions(url: str, prompts: list[list[int]]) -> list[dict]:
    with httpx.Client(timeout=300) as client:
        replies = [
            client.post(
                url + "/v1/completions",
                json={"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
            )
            for p in prompts
        ]
    for reply in replies:
        reply.raise_for_status()
    return [r.json()["choices"][0] for r in replies]


def test_the_benchmark_model_crosses_from_tp2_to_attention_dp(benchmark_model, tmp_path):
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, 512, (3, 400), generator=generator).tolist()  # 4 blocks: sparse
    (tmp_path / "agg").mkdir()
    with running(tmp_path / "agg") as servers:
        servers.server("agg", benchmark_model)
        servers.wait_healthy()
        expected = completions(servers.urls["agg"], prompts)
    layouts = (TP2, ADP2)
    with disaggregated_deployment(benchmark_model, "cpu", tmp_path, layouts=layouts) as urls:
        got = completions(urls["router"], prompts)
        assert metric(urls["gen"], "trtllm_context_tokens_computed_total") == 0
        assert metric(urls["gen"], "trtllm_transferred_tokens_total") == 3 * 400
        assert_nothing_held(urls["ctx"], urls["gen"])
    assert [c["text"] for c in got] == [c["text"] for c in expected]
    assert [c["avg_decoded_tokens_per_iter"] for c in got] == pytest.approx(
        [c["avg_decoded_tokens_per_iter"] for c in expected], abs=0.02
    )
