"""A request cannot hurt others (issue 37): poison pills sent beside running streams are refused
alone with a 400 naming the field, the streams run to their end with the tokens they have alone,
and every error the server answers is an OpenAI error object (live server, bundled model with
Eagle3 unified, CPU)."""

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tensorrt_llm.bundled import bundled_prompt

PROMPT = bundled_prompt("Ann has 58 cups. Ann gets 67 more cups. How many cups?")
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


def raw_request(url: str, head: str, chunks=(), timeout: float = 30) -> tuple[int, dict]:
    """Send ``head`` (request line and headers) then ``chunks`` on one socket; the status and the
    JSON body of the reply (what the server answered, even if it stopped reading early; None when
    the HTTP layer refused the request before the app saw it)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n")
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-body: the answer is already there
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    status = int(reply.split(b" ", 2)[1])
    head, body = reply.split(b"\r\n\r\n", 1)
    return status, json.loads(body) if b"application/json" in head.lower() else None


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def chunked(total: int, size: int = 1 << 20):
    """A JSON body of ``total`` bytes in HTTP chunks of ``size``."""
    body = b'{"prompt": "' + b"a" * (total - 15) + b'"}'
    for i in range(0, len(body), size):
        part = body[i : i + size]
        yield b"%x\r\n%s\r\n" % (len(part), part)
    yield b"0\r\n\r\n"


def test_a_chunked_body_over_the_limit_is_a_413_before_it_is_read(url):
    rss_before = _rss_bytes()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n"
    )
    status, body = raw_request(url, head, chunked(16 * 2**20))
    assert status == 413 and body["error"]["code"] == 413
    assert "limit is 8388608" in body["error"]["message"]
    assert _rss_bytes() - rss_before < 64 * 2**20  # nothing near the body's size was kept
    assert httpx.get(url + "/health").status_code == 200 and slots_in_use(url) == 0


@pytest.mark.parametrize(
    "headers, status",
    [
        ("Content-Length: 16\r\nTransfer-Encoding: chunked\r\n", 400),
        ("Content-Length: 99999999999\r\n", 413),
        ("Content-Length: 16\r\nContent-Length: 17\r\n", 400),  # (the HTTP layer's refusal)
    ],
)
def test_a_body_whose_length_headers_disagree_or_lie_is_refused(url, headers, status):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
    )
    got, body = raw_request(url, head, [b'{"prompt": "hi"}'])
    assert got == status and (body is None or body["error"]["code"] == status), body


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize(
    "raw, param",
    [
        ('{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages.0.content"),
        ('{"prompt": "a\\udc00"}', "prompt"),
        ('{"prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
        ('{"prompt": []}', "prompt"),
        ('{"prompt": ["a", "b", "c"], "n": 6}', "prompt"),
    ],
)
def test_every_refusal_is_an_openai_error_naming_its_field(url, raw, param):
    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
    reply = httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and "Value error" not in error["message"]


class HealthPoller:
    """Polls ``/health`` every 20 ms on its own thread; ``worst`` is the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.stop = url, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                assert client.get(self.url + "/health").status_code == 200
                self.worst = max(self.worst, time.monotonic() - start)
                time.sleep(0.02)

    def __enter__(self) -> "HealthPoller":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def test_a_6_mb_prompt_is_refused_by_its_length_while_health_is_polled(url):
    text = "Ann has 58 cups. " * (6 * 2**20 // 17)
    with HealthPoller(url) as health:
        for path, body, param in (
            ("/v1/completions", {"prompt": text}, "prompt"),
            ("/v1/completions", {"prompt": ["hi", text]}, "prompt.1"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
             "messages.0.content"),
        ):  # fmt: skip
            start = time.monotonic()
            reply = httpx.post(url + path, json=body, timeout=60)
            assert time.monotonic() - start < 2.0
            error = reply.json()["error"]
            assert reply.status_code == 400 and error["param"] == param, error
            assert "the most that max_seq_len=2048 tokens of this tokenizer can hold" in str(error)
    assert health.worst < 0.5, f"/health took {health.worst:.2f}s"
    assert slots_in_use(url) == 0


def test_max_tokens_past_max_seq_len_or_the_request_bound_is_a_400(url):
    for body, message in (
        ({"max_tokens": 10**9}, "passes max_seq_len=2048"),
        ({"max_tokens": 2040}, "passes max_seq_len=2048"),
        ({"max_tokens": 1100, "n": 16}, "17600 completion tokens; this server takes at most 16384"),
    ):
        reply = httpx.post(url + "/v1/completions", json={"prompt": "hello there", **body})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "max_tokens", error
        assert message in error["message"]
    assert slots_in_use(url) == 0


def test_a_request_of_many_long_samples_leaves_room_for_the_next_one(url):
    many = {"prompt": PROMPT, "n": 12, "max_tokens": 64, "ignore_eos": True, "temperature": 1}
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(httpx.post, url + "/v1/completions", json=many, timeout=300)
        time.sleep(0.5)
        start = time.monotonic()
        short = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        waited = time.monotonic() - start
        assert short.status_code == 200 and not long.done()
        assert len(long.result().json()["choices"]) == 12
        total = time.monotonic() - start
    assert waited < total / 3, (waited, total)  # it ran beside the long one, not after it
    assert slots_in_use(url) == 0
