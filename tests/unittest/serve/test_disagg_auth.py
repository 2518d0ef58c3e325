"""A server with a KV transceiver takes ``disaggregated_params`` only from its deployment's router
(issue 11, item 5: nobody else can pin its slots with context-only requests or start a
generation-only one): without the secret in the auth header, a 403 naming the field."""

import os

import pytest
from fastapi.testclient import TestClient

from tensorrt_llm import LLM
from tensorrt_llm._torch.disaggregation.trust import DISAGG_AUTH_HEADER
from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig, KvCacheConfig
from tensorrt_llm.serve.openai_server import OpenAIServer

pytest.importorskip("nixl")
BODY = {
    "prompt": "12+7=",
    "max_tokens": 4,
    "disaggregated_params": {"request_type": "context_only"},
}


@pytest.fixture(scope="module")
def client():
    llm = LLM(
        device="cpu",
        kv_cache_config=KvCacheConfig(max_tokens=128 * 8),
        cache_transceiver_config=CacheTransceiverConfig(transfer_timeout_s=5),
    )
    server = OpenAIServer(llm, "m3-tiny")
    with TestClient(server.app) as client:
        yield client, llm
    llm.shutdown()


@pytest.mark.parametrize("header", [None, "not-the-deployment-secret"], ids=["none", "wrong"])
def test_disaggregated_params_without_the_secret_are_refused(client, header):
    client, llm = client
    headers = {} if header is None else {DISAGG_AUTH_HEADER: header}
    reply = client.post("/v1/completions", json=BODY, headers=headers)
    error = reply.json()["error"]
    assert reply.status_code == 403 and error["type"] == "permission_error"
    assert error["param"] == "disaggregated_params" and DISAGG_AUTH_HEADER in error["message"]
    assert llm.get_stats()["held_for_transfer"] == 0  # nothing prefilled, nothing held


def test_the_router_with_the_secret_gets_a_signed_handle(client):
    client, llm = client
    headers = {DISAGG_AUTH_HEADER: os.environ["TRTLLM_DISAGG_SECRET"]}
    reply = client.post("/v1/completions", json=BODY, headers=headers)
    params = reply.json()["disaggregated_params"]
    assert reply.status_code == 200 and params["request_type"] == "context_only"
    assert len(params["signature"]) == 64 and len(params["transfer_handle"]["transfer_id"]) >= 16
    assert llm.get_stats()["held_for_transfer"] == 1


def test_holds_that_fill_max_held_fraction_refuse_new_context_requests():
    # issue 11, item 5: unpulled holds used to pin 15 of 16 slots while new requests waited
    llm = LLM(
        device="cpu",
        kv_cache_config=KvCacheConfig(max_tokens=128 * 8),
        cache_transceiver_config=CacheTransceiverConfig(
            transfer_timeout_s=30, max_held_fraction=0.25
        ),
    )
    server = OpenAIServer(llm, "m3-tiny")
    headers = {DISAGG_AUTH_HEADER: os.environ["TRTLLM_DISAGG_SECRET"]}
    with TestClient(server.app) as client:
        codes = [client.post("/v1/completions", json=BODY, headers=headers) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]  # 2 of 8 slots held: the limit
    error = codes[2].json()["error"]
    assert error["type"] == "rate_limit_error" and "max_held_fraction" in error["message"]
    assert llm.disaggregated.held_slots() == 2
    llm.shutdown()
