"""Connections are bounded: a client that sends nothing, or trickles its headers, is closed after
the header timeout; the connection past the most at once gets a 503 error object at once."""

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from tensorrt_llm.serve.connections import ConnectionLimits
from tensorrt_llm.serve.middleware import BodySizeLimit

TIMEOUT_S = 0.4


@pytest.fixture(scope="module")
def url():
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    app.add_middleware(BodySizeLimit, body_timeout_s=TIMEOUT_S)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    protocol = ConnectionLimits(max_connections=3, header_timeout_s=TIMEOUT_S).protocol()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=protocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", port
    server.should_exit = True
    thread.join(timeout=10)


def closed_after(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``limit_s``)."""
    sock.settimeout(limit_s)
    start = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    return time.monotonic() - start


def test_a_silent_or_trickling_client_is_closed_after_the_header_timeout(url):
    _, port = url
    silent = socket.create_connection(("127.0.0.1", port))
    trickle = socket.create_connection(("127.0.0.1", port))
    trickle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # (the headers never end)
    for sock in (silent, trickle):
        took = closed_after(sock, 5)
        assert took is not None and took < TIMEOUT_S + 1.0
        sock.close()


def test_the_connection_past_the_most_gets_a_503_and_the_server_goes_on(url):
    base, port = url
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    time.sleep(0.05)
    extra = socket.create_connection(("127.0.0.1", port))
    extra.settimeout(2)
    reply = b""
    while chunk := extra.recv(4096):
        reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503")
    assert json.loads(body)["error"]["code"] == 503
    for sock in held:
        sock.close()
    time.sleep(0.05)
    assert httpx.get(base + "/health").json() == {"status": "ok"}


def test_a_keep_alive_connection_serves_requests_after_the_timeout(url):
    base, _ = url
    with httpx.Client() as client:
        assert client.get(base + "/health").status_code == 200
        time.sleep(TIMEOUT_S + 0.2)  # (idle between requests: the keep-alive timeout's business)
        assert client.get(base + "/health").status_code == 200


def test_a_body_that_trickles_past_the_body_timeout_is_a_408(url):
    base, port = url
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        sock.settimeout(5)
        start = time.monotonic()
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < TIMEOUT_S + 1
    assert httpx.post(base + "/echo", content=b"x" * 100).json() == {"bytes": 100}
