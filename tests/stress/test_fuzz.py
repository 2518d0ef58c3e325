"""A schema fuzz of the OpenAI endpoints of a real server: hypothesis-made bodies, some close to
valid and some far from it, with values at and past the edges of what the engine represents
(huge top-k and seeds, NaN and infinities, lone surrogates). Every answer is a 200 or a 4xx
carrying an OpenAI error object (never a 5xx, never a plain-text error); a stream that runs beside
the fuzz is never cut (no body aborts a batch); afterwards the server is healthy and keeps no KV
slot."""

import json
import threading

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
    st.integers(min_value=2**63 - 20, max_value=2**64 + 1),
    st.floats(),  # NaN and infinities too (JSON as Python writes it)
    st.text(max_size=12),
    st.just("[e~[\n]~b]ai\n"),
    st.just("\ud800"),
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
    "top_k": st.one_of(st.integers(0, 50), st.integers(2**62, 2**64 + 1)),
    "seed": st.one_of(st.integers(0, 2**31), st.integers(2**63 - 20, 2**63)),
    "n": st.integers(1, 3),
    "presence_penalty": st.floats(-3, 3),
    "stop": st.lists(st.text(max_size=3), max_size=2),
    "stream": st.booleans(),
}
_other_keys = ["disaggregated_params", "unknown_field", "messages", "prompt", "logprobs"]


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
        assert not error_events(reply.text), (body, reply.text[-300:])


def error_events(stream: str) -> list[dict]:
    events = [line[6:] for line in stream.splitlines() if line.startswith("data: {")]
    return [e for e in map(json.loads, events) if "error" in e]


@pytest.mark.parametrize(
    "path, strategy", [("chat/completions", CHAT), ("completions", COMPLETION)]
)
def test_any_body_gets_a_200_or_an_openai_error(single, path, strategy):
    base = single.urls["one"]
    url = f"{base}/v1/{path}"
    streams = []

    def beside():  # streams that run while the fuzz does: none may end in an error event
        while not done.is_set():
            body = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as reply:
                streams.append(reply.read().decode())

    done = threading.Event()
    runner = threading.Thread(target=beside)
    runner.start()

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(strategy)
    def fuzz(body):
        check(url, body)

    try:
        fuzz()
    finally:
        done.set()
        runner.join()
    assert streams and all(s.endswith("data: [DONE]\n\n") for s in streams)
    assert not [e for s in streams for e in error_events(s)]
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    assert_no_slot_in_use(base)
