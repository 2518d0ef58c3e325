"""vLLM's ``stop_token_ids``, ``bad_words`` and ``allowed_token_ids`` through a live trtllm-serve
of the bundled model (Eagle3 unified, CPU): each one changes the reply as it says, a bad value
is a 400 naming its field, and no request leaves a KV slot held."""

import re

import httpx
import pytest

from tensorrt_llm.bundled import bundled_prompt
from tensorrt_llm.serve.openai_protocol import CompletionRequest

QUESTION = "Ann has 58 cups. Ann gets 67 more cups. How many cups does Ann have now?"
PLAIN = "58 + 67: 8 + 7 = 15, 5 +"  # its greedy reply's first 24 tokens


@pytest.fixture(scope="module")
def server(bundled_server):
    return bundled_server


@pytest.fixture(autouse=True)
def no_slot_held(server):
    yield
    assert server[0].llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0


def complete(server, **fields) -> httpx.Response:
    body = {
        "prompt": bundled_prompt(QUESTION, thinking_mode="disabled"),
        "max_tokens": 24,
        "temperature": 0,
        **fields,
    }
    return httpx.post(server[1] + "/v1/completions", json=body, timeout=60)


def choice(server, **fields) -> dict:
    reply = complete(server, **fields)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_the_fields_are_read_and_empty_lists_constrain_nothing(server):
    body = {"prompt": "hi", "stop_token_ids": [], "bad_words": [], "allowed_token_ids": [1]}
    assert CompletionRequest(**body).ignored_fields() == []
    assert choice(server, stop_token_ids=[], bad_words=[])["text"] == PLAIN


def test_allowed_token_ids_keep_the_reply_to_their_tokens(server):
    encode = server[0].llm.tokenizer.encode
    digits = choice(server, allowed_token_ids=encode("0123456789"))["text"]
    assert len(digits) == 24 and set(digits) <= set("0123456789")


def test_a_refused_tokens_logprob_is_vllms_floor_not_json_breaking_inf(server):
    # two tokens allowed, four asked for: the other two are refused, -inf, sent as -9999.0
    allowed = server[0].llm.tokenizer.encode("01")
    top = choice(server, allowed_token_ids=allowed, logprobs=4, max_tokens=2)["logprobs"]
    for alternatives in top["top_logprobs"]:
        assert sorted(alternatives.values())[:2] == [-9999.0, -9999.0]
        assert all(lp > -9999.0 for lp in sorted(alternatives.values())[2:])


def test_a_bad_word_never_appears(server):
    text = choice(server, bad_words=["15"])["text"]
    assert text.startswith("58 + 67: 8 + 7 = ") and "15" not in text


def test_a_stop_token_ends_the_reply_before_it(server):
    (equals,) = server[0].llm.tokenizer.encode("=")
    out = choice(server, stop_token_ids=[equals])
    assert out["text"] == "58 + 67: 8 + 7 " and out["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("stop_token_ids", [-1], "token ids"),
        ("stop_token_ids", [136], r"not in \[0, 136\)"),
        ("stop_token_ids", [1] * 257, "at most 256"),
        ("allowed_token_ids", [], "non-empty"),
        ("allowed_token_ids", [5, 1000], r"not in \[0, 136\)"),
        ("allowed_token_ids", [1] * 137, "over the vocabulary"),
        ("bad_words", ["ok", " "], "other than whitespace"),
        ("bad_words", ["x"] * 129, "at most 128 words"),
        ("bad_words", ["x" * 17], "17 tokens"),
        ("bad_words", "x", "list"),
    ],
)
def test_a_bad_value_is_a_400_naming_its_field(server, field, value, message):
    reply = complete(server, **{field: value})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == field, error
    assert error["type"] == "invalid_request_error"
    assert re.search(message, error["message"]), error["message"]
