"""Disaggregated deployments on GPUs (KV pulled over NIXL/UCX from VRAM) pass the AL gate of the
AL table: the same gsm8k-tiny replies and AL as an aggregated server, with no prefill on the
generation side.

- one rank each: context server on GPU 0, generation server on GPU 1 (two GPUs);
- the parallel arm: a TP2 context server (block reuse, chunked prefill) and a TP2 attention-DP
  generation server (CUDA graphs, no block reuse) through the router, heads regrouped between the
  layouts, the ``[unified-kv]`` layout logged on every rank: on four GPUs (two each), or on two
  GPUs shared by both servers.

Skipped with fewer GPUs than a case needs."""

import pytest
import torch

from tensorrt_llm.bundled import bundled_eagle3
from tensorrt_llm.evaluate.deployment import disaggregated_deployment, metric, running
from tensorrt_llm.evaluate.runner import run_gsm8k_http

pytest.importorskip("nixl")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
CONTEXT_TP2 = {
    "tensor_parallel_size": 2,
    "enable_chunked_prefill": True,
    "kv_cache_config": {"max_tokens": 65536, "enable_block_reuse": True},
}
GENERATION_ADP2 = {
    "tensor_parallel_size": 2,
    "enable_attention_dp": True,
    "kv_cache_config": {"max_tokens": 65536, "enable_block_reuse": False},
}
OPTIONS = {
    "speculative_config": bundled_eagle3(),
    "kv_cache_config": {"max_tokens": 65536},
}


def test_context_on_gpu0_generation_on_gpu1_keeps_the_al(tmp_path):
    with running(tmp_path) as servers:
        servers.server("agg", OPTIONS, "cuda", gpus="0")
        servers.wait_healthy()
        aggregated = run_gsm8k_http(servers.urls["agg"], 40)
    with disaggregated_deployment(OPTIONS, "cuda", tmp_path, ("0", "1")) as urls:
        disaggregated = run_gsm8k_http(urls["router"], 40)
        assert metric(urls["gen"], "trtllm_context_tokens_computed_total") == 0
        assert metric(urls["gen"], "trtllm_transferred_tokens_total") > 0
    assert disaggregated["texts"] == aggregated["texts"]
    assert disaggregated["accuracy"] >= 0.9
    assert abs(disaggregated["al"] - aggregated["al"]) <= 0.05  # the AL table's gate


@pytest.mark.parametrize(
    "gpus",
    [
        pytest.param(
            ("0,1", "2,3"),
            id="four-gpus",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs"),
        ),
        pytest.param(("0,1", "0,1"), id="two-gpus-shared"),
    ],
)
def test_tp2_context_to_attention_dp_generation_through_the_router(gpus, tmp_path):
    (tmp_path / "agg").mkdir()
    with running(tmp_path / "agg") as servers:
        servers.server("agg", OPTIONS, "cuda", gpus="0")
        servers.wait_healthy()
        aggregated = run_gsm8k_http(servers.urls["agg"], 40)
    layouts = (CONTEXT_TP2, GENERATION_ADP2)
    with disaggregated_deployment(OPTIONS, "cuda", tmp_path, gpus, layouts) as urls:
        disaggregated = run_gsm8k_http(urls["router"], 40)
        computed = metric(urls["gen"], "trtllm_context_tokens_computed_total")
        transferred = metric(urls["gen"], "trtllm_transferred_tokens_total")
    print(
        f"gsm8k-tiny, 40 problems: accuracy {disaggregated['accuracy']:.3f}, AL aggregated "
        f"{aggregated['al']:.3f} vs disaggregated {disaggregated['al']:.3f}; generation side: "
        f"{transferred:.0f} prompt tokens pulled, {computed:.0f} computed"
    )
    assert computed == 0 and transferred > 0
    assert disaggregated["texts"] == aggregated["texts"]
    assert disaggregated["accuracy"] >= 0.9
    assert abs(disaggregated["al"] - aggregated["al"]) <= 0.05  # the AL table's gate
    for name in ("ctx", "gen"):
        log = (tmp_path / f"{name}.log").read_text()
        for rank in range(2):
            assert f"[RANK {rank}] [INFO] [unified-kv] draft layers" in log, (name, rank)
