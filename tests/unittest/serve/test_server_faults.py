"""A request cannot hurt others (issue 37): poison pills sent beside running streams are refused
alone with a 400 naming the field, the streams run to their end with the tokens they have alone,
and every error the server answers is an OpenAI error object (live server, bundled model with
Eagle3 unified, CPU)."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

PROMPT = "<|user|>Ann has 58 cups. Ann gets 67 more cups. How many cups?<|end|><|assistant|>"
STREAM = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def url(bundled_server):
    return bundled_server[1]


def stream(url: str, body: dict) -> tuple[str, list[dict]]:
    """A streamed completion: its text and its events (an error event included)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return text, events


def slots_in_use(url: str) -> int:
    """KV slots and live sequences of every manager, requests active and KV held for pulls (each
    ``/kv_cache`` runs ``check_integrity`` too)."""
    report = httpx.get(url + "/kv_cache").json()
    managers = [v for v in report.values() if isinstance(v, dict)]
    held = report["held_for_transfer"] + report["active_requests"]
    return sum(m["used"] + m["live_requests"] for m in managers) + held


POISON = [  # (raw JSON body, the field its 400 must name)
    ('{"prompt": "hi", "top_k": 18446744073709551616, "temperature": 1}', "top_k"),
    ('{"prompt": "hi", "seed": 9223372036854775807, "n": 2, "temperature": 1}', "seed"),
    ('{"prompt": "hi", "presence_penalty": NaN, "temperature": 1}', "presence_penalty"),
    ('{"prompt": "hi", "frequency_penalty": Infinity}', "frequency_penalty"),
    ('{"prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
]
EDGES = [  # at the edge of what the engine represents: they run, beside the others
    {"prompt": "hi", "top_k": 2**63 - 1, "temperature": 1, "max_tokens": 4},
    {"prompt": "hi", "seed": 2**63 - 1, "temperature": 1, "max_tokens": 4},
    {"prompt": "hi", "seed": 2**63 - 2, "n": 2, "temperature": 1, "max_tokens": 4},
]


def test_poison_pills_beside_running_streams_fail_alone(url):
    alone, _ = stream(url, STREAM)
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream, url, STREAM) for _ in range(3)]
        for raw, field in POISON * 2:
            reply = httpx.post(
                url + "/v1/completions",
                content=raw,
                headers={"Content-Type": "application/json"},
            )
            error = reply.json()["error"]
            assert (reply.status_code, error["param"]) == (400, field), (raw, error)
            assert error["type"] == "invalid_request_error" and field in error["message"]
        for body in EDGES:
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert all(c["finish_reason"] == "length" for c in reply.json()["choices"])
        results = [s.result(timeout=120) for s in streams]
    for text, events in results:
        assert not [e for e in events if "error" in e]
        assert text == alone and events[-1]["choices"][0]["finish_reason"] == "length"
    assert slots_in_use(url) == 0
