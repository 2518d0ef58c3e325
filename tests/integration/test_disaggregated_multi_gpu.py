"""A disaggregated deployment across two GPUs (context server on GPU 0, generation server on GPU 1,
KV pulled over NIXL/UCX from VRAM) passes the AL gate of the AL table: the same gsm8k-tiny AL as
an aggregated server, with no prefill on the generation side. Skipped with fewer than two GPUs."""

import pytest
import torch

from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.evaluate.deployment import disaggregated_deployment, metric, running
from tensorrt_llm.evaluate.runner import run_gsm8k_http, training_questions

pytest.importorskip("nixl")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
OPTIONS = {
    "speculative_config": {
        "decoding_type": "Eagle3",
        "max_draft_len": 3,
        "speculative_model": str(BUNDLED_DRAFT),
        "draft_kv_cache": "unified",
    },
    "kv_cache_config": {"max_tokens": 65536},
}


def test_context_on_gpu0_generation_on_gpu1_keeps_the_al(tmp_path):
    exclude = training_questions(BUNDLED_TARGET, BUNDLED_DRAFT)
    with running(tmp_path) as servers:
        servers.server("agg", OPTIONS, "cuda", gpus="0")
        servers.wait_healthy()
        aggregated = run_gsm8k_http(servers.urls["agg"], 40, exclude)
    with disaggregated_deployment(OPTIONS, "cuda", tmp_path, ("0", "1")) as urls:
        disaggregated = run_gsm8k_http(urls["router"], 40, exclude)
        assert metric(urls["gen"], "trtllm_context_tokens_computed_total") == 0
        assert metric(urls["gen"], "trtllm_transferred_tokens_total") > 0
    assert disaggregated["texts"] == aggregated["texts"]
    assert disaggregated["accuracy"] >= 0.9
    assert abs(disaggregated["al"] - aggregated["al"]) <= 0.05  # the AL table's gate
