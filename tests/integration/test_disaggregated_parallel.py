"""Disaggregated serving between servers of several ranks, on the CPU (gloo, NIXL over UCX in
DRAM): a tensor-parallel context server feeds a generation server of another layout (one rank,
attention DP, tensor parallel), and a one-rank context server feeds a tensor-parallel one. Heads
are regrouped between the layouts; the replies equal an aggregated one-rank server's, the
generation side computes no prompt token, and no slot stays held on either side."""

import time

import pytest

from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.deployment import chat_many, disaggregated_deployment, metric, running

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow
OPTIONS = {
    "speculative_config": {
        "decoding_type": "Eagle3",
        "max_draft_len": 3,
        "speculative_model": str(BUNDLED_DRAFT),
        "draft_kv_cache": "unified",
    },
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


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    with running(tmp_path_factory.mktemp("agg")) as servers:
        servers.server("agg", OPTIONS)
        servers.wait_healthy()
        yield chat_many(servers.urls["agg"], CONVERSATIONS, max_tokens=48)


@pytest.mark.parametrize(
    "layouts",
    [(TP2, ADP2), (TP2, TP1), (TP1, TP2), (TP2, TP2)],
    ids=["tp2-to-adp2", "tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2"],
)
def test_kv_crosses_between_parallel_layouts(layouts, expected, tmp_path):
    with disaggregated_deployment(OPTIONS, "cpu", tmp_path, layouts=layouts) as urls:
        replies = chat_many(urls["router"], CONVERSATIONS, max_tokens=48)
        assert [r["text"] for r in replies] == [r["text"] for r in expected]
        assert [r["al"] for r in replies] == pytest.approx([r["al"] for r in expected], abs=0.02)
        gen, ctx = urls["gen"], urls["ctx"]
        assert metric(gen, "trtllm_context_tokens_computed_total") == 0  # no prefill there
        assert metric(gen, "trtllm_transferred_tokens_total") > 0
        deadline = time.time() + 10
        while time.time() < deadline and metric(ctx, "trtllm_held_for_transfer"):
            time.sleep(0.2)  # released once pulled (on every context rank)
        for url in (ctx, gen):
            assert metric(url, "trtllm_held_for_transfer") == 0
            assert metric(url, 'trtllm_kv_cache_slots{state="used"}') == 0
