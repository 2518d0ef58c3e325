"""Request validation of the OpenAI endpoints (issue 11, item 12): no silent coercion of types,
parameters named correctly, client errors typed as such, and every error an OpenAI error object."""

import pytest
from fastapi.testclient import TestClient

from tensorrt_llm import LLM
from tensorrt_llm.llmapi.llm_args import KvCacheConfig
from tensorrt_llm.serve.openai_server import OpenAIServer


@pytest.fixture(scope="module")
def client():
    server = OpenAIServer(LLM(device="cpu", kv_cache_config=KvCacheConfig(max_tokens=128 * 4)), "m")
    with TestClient(server.app) as client:
        yield client
    server.shutdown()


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", True),
        ("max_tokens", "8"),
        ("stream", "yes"),
        ("ignore_eos", 1),
        ("seed", 2**70),
        ("seed", -1),
        ("top_k", 2.5),
    ],
)
def test_a_mistyped_or_out_of_range_field_is_a_400_naming_it(client, field, value):
    reply = client.post("/v1/completions", json={"prompt": "hi", field: value})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == field, error
    assert error["type"] == "invalid_request_error"


def test_a_request_the_cache_cannot_hold_is_a_client_error(client):
    reply = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100_000})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["type"] == "invalid_request_error"
    assert "KV slots" in error["message"] or "max_seq_len" in error["message"]


@pytest.mark.parametrize(
    "method, path, status", [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]
)
def test_unknown_paths_and_methods_are_openai_errors(client, method, path, status):
    reply = client.request(method, path)
    error = reply.json()["error"]
    assert reply.status_code == status and error["code"] == status
    assert path in error["message"] and "detail" not in reply.json()


@pytest.mark.parametrize("body", ["[]", "null", "{not json"])
def test_a_body_that_is_not_a_request_object_is_a_400(client, body):
    reply = client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_kv_cache_dtype_is_refused_at_configuration():
    with pytest.raises(ValueError, match="dtype"):
        KvCacheConfig(dtype="fp8")


def test_a_body_over_the_limit_is_a_413_before_it_is_read(client):
    # issue 11, item 11: a 10 MB body used to be read and tokenized on the event loop
    body = '{"prompt": "' + "a" * (10 * 2**20) + '"}'
    reply = client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert reply.status_code == 413 and "limit" in reply.json()["error"]["message"]
