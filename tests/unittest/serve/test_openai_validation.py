"""Request validation of the OpenAI endpoints (issue 11, item 12): no silent coercion of types,
parameters named correctly, client errors typed as such, and every error an OpenAI error object."""

import pytest
from fastapi.testclient import TestClient

from tensorrt_llm import LLM
from tensorrt_llm.llmapi.llm_args import KvCacheConfig
from tensorrt_llm.serve.media import INLINE_TEXT_CHARS
from tensorrt_llm.serve.openai_server import OpenAIServer


@pytest.fixture(scope="module")
def client():
    server = OpenAIServer(LLM(device="cpu", kv_cache_config=KvCacheConfig(max_tokens=128 * 4)), "m")
    with TestClient(server.app) as client:
        client.server = server
        yield client
    server.close()


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
    with pytest.raises(ValueError, match="dtype(.|\n)*'bfloat16' or 'fp8'"):
        KvCacheConfig(dtype="nvfp4")


def test_a_body_over_the_limit_is_a_413_before_it_is_read(client):
    # issue 11, item 11: a 10 MB body used to be read and tokenized on the event loop
    body = '{"prompt": "' + "a" * (10 * 2**20) + '"}'
    reply = client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert reply.status_code == 413 and "limit" in reply.json()["error"]["message"]


def test_unknown_fields_are_ignored_with_a_warning(client, caplog):
    # issue 12, item 2: what vLLM does; real clients send fields this server has no use for
    body = {"prompt": "hi", "max_tokens": 2, "store": True, "metadata": {"a": "b"}, "user": "u"}
    with caplog.at_level("WARNING", logger="tensorrt_llm"):
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert any(
        "ignoring unknown field(s) ['metadata', 'store']" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("logit_bias", {"x": 10}),
        ("logit_bias", {"100000": 10}),
        ("logit_bias", {"5": 101}),
        ("best_of", 3),
        ("echo", True),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_schema", "json_schema": {}}),
        ("n", 17),
    ],
)
def test_a_field_that_would_change_the_result_is_refused_not_ignored(client, field, value):
    reply = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == field, error


@pytest.mark.parametrize(
    "field, value",
    [("echo", False), ("logit_bias", {}), ("response_format", {"type": "text"})],
)
def test_the_default_of_an_unsupported_field_is_accepted(client, field, value):
    reply = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
    assert reply.status_code == 200, reply.text


def test_chat_content_as_text_parts_is_the_joined_text(client):
    def answer(content):
        body = {"messages": [{"role": "user", "content": content, "name": "ann"}], "max_tokens": 8}
        reply = client.post("/v1/chat/completions", json={**body, "temperature": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    parts = [{"type": "text", "text": "Ann has 5 cups. "}, {"type": "text", "text": "How many?"}]
    assert answer(parts) == answer("Ann has 5 cups. How many?")


@pytest.mark.parametrize("size", [2, INLINE_TEXT_CHARS + 1])  # on the event loop; on a thread
def test_a_message_the_checkpoints_template_refuses_is_a_400(client, monkeypatch, size):
    # a checkpoint's own template may refuse a conversation (many refuse a system message)
    tokenizer = client.server.llm.tokenizer
    refusing = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    )
    monkeypatch.setattr(tokenizer, "chat_template", refusing)
    body = {"messages": [{"role": "system", "content": "h" * size}], "max_tokens": 2}
    reply = client.post("/v1/chat/completions", json=body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "messages", error
    assert "no system role" in error["message"]


def test_thinking_asked_two_ways_that_disagree_is_a_400(client):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "reasoning_effort": "none",
        "thinking": {"type": "enabled"},
    }
    reply = client.post("/v1/chat/completions", json=body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and "the ways to ask for thinking disagree" in error["message"]


def tool(name: str = "add", parameters=None) -> dict:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    return {"type": "function", "function": {"name": name, "parameters": parameters or schema}}


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": [tool()]}, "tools", "start it with --tool_parser"),
        ({"tools": [tool(parameters={"type": "string"})]}, "tools", "schema of an object"),
        ({"tools": [tool(name="has space")]}, "tools", "pattern"),
        ({"tools": [tool(), tool()]}, "tools", "repeat"),
        ({"tools": [tool(f"t{i}") for i in range(129)]}, "tools", "at most 128"),
        ({"tools": [tool(parameters={"description": "x" * 300_000})]}, "tools", "bytes of JSON"),
        ({"tools": [tool()], "tool_choice": "required"}, "tool_choice", "--tool_parser"),
        (
            {"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "b"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "json_object"}}, "response_format", "--guided_decoding"),
        ({"response_format": {"type": "xml"}}, "response_format", "expected one of"),
        ({"response_format": {"type": "regex"}}, "response_format", "needs response_format.regex"),
    ],
)
def test_tools_a_server_cannot_take_are_a_400_naming_the_field(client, fields, param, message):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    reply = client.post("/v1/chat/completions", json=body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"].startswith(param), error
    assert message in error["message"], error


def test_tools_with_tool_choice_none_are_not_read_for_calls(client):
    # (without a tool parser nothing reads the reply for calls)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = client.post(
        "/v1/chat/completions", json={**body, "tools": [tool()], "tool_choice": "none"}
    )
    assert reply.status_code == 200, reply.text
    assert "tool_calls" not in reply.json()["choices"][0]["message"]
