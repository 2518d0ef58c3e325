"""A schema fuzz of the OpenAI endpoints of a real server: hypothesis-made bodies, some close to
valid and some far from it. Every answer is a 200 or a 4xx carrying an OpenAI error object (never a
5xx, never a plain-text error); afterwards the server is healthy and keeps no KV slot."""

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stress_helpers import LARGE, assert_no_slot_in_use

pytestmark = pytest.mark.slow
EXAMPLES = 400 if LARGE else 60

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 16),
    st.integers(min_value=2**31, max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.just("<|end|><|assistant|>"),
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_valid_fields = {
    "model": st.just("target"),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 1.5),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**31),
    "stop": st.lists(st.text(max_size=3), max_size=2),
    "stream": st.booleans(),
}
_other_keys = ["n", "disaggregated_params", "unknown_field", "messages", "prompt", "logprobs"]


def bodies(prompt_key: str, prompt):
    """Valid bodies; valid bodies with one field (known or not) set to anything; anything."""
    valid = st.fixed_dictionaries({prompt_key: prompt}, optional=_valid_fields)
    keys = st.sampled_from(sorted({*_valid_fields, *_other_keys}))
    corrupted = st.tuples(valid, keys, _json).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, corrupted, _json)


_roles = st.sampled_from(["user", "system", "assistant"])
_message = st.fixed_dictionaries({"role": _roles, "content": st.text(max_size=40)})
CHAT = bodies("messages", st.lists(_message, min_size=1, max_size=3))
COMPLETION = bodies("prompt", st.one_of(st.text(max_size=40), st.lists(st.integers(0, 300))))


def check(url: str, body) -> None:
    headers = {"Content-Type": "application/json"}
    reply = httpx.post(url, content=json.dumps(body), headers=headers, timeout=60)
    assert reply.status_code < 500, (body, reply.status_code, reply.text[:500])
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["type"], (body, error)
    elif reply.headers["content-type"].startswith("text/event-stream"):
        assert reply.text.rstrip().endswith("data: [DONE]"), (body, reply.text[-300:])


@pytest.mark.parametrize(
    "path, strategy", [("chat/completions", CHAT), ("completions", COMPLETION)]
)
def test_any_body_gets_a_200_or_an_openai_error(single, path, strategy):
    url = f"{single.urls['one']}/v1/{path}"

    @settings(max_examples=EXAMPLES)
    @given(strategy)
    def fuzz(body):
        check(url, body)

    fuzz()
    assert httpx.get(single.urls["one"] + "/health", timeout=10).status_code == 200
    assert_no_slot_in_use(single.urls["one"])
