"""The media fetch policy (issue 37): image URLs reach only global addresses (every hop checked,
the address checked being the one connected to), or the hosts the operator names; one answer for
every failure; one deadline per fetch; the size cap while reading; a bounded pool of image jobs
(a 503 past it) that a client leaving cancels; decoding bounded by the processor's pixel budget.

The servers here are local ones, so each test that reaches one names ``localhost`` in
``--allowed-media-domains``; the loopback listener that must see no connection is the canary."""

import asyncio
import base64
import io
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from tensorrt_llm.inputs.image_processing import ImageProcessorConfig, MiniMaxM3ImageProcessor
from tensorrt_llm.serve.media import UNFETCHABLE, MediaOptions, MediaPool
from tensorrt_llm.serve.media_fetch import FetchPolicy, FetchRefused, fetch


def png(height: int = 30, width: int = 40) -> bytes:
    pixels = np.random.RandomState(0).randint(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


class Canary:
    """A loopback listener that counts the connections it gets (none, if the policy holds)."""

    def __init__(self, family=socket.AF_INET, host="127.0.0.1") -> None:
        self.sock = socket.socket(family)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


class Images(BaseHTTPRequestHandler):
    """/cat.png, /text, /to?<url> (a redirect), /slow (a byte every 0.5 s), /endless (no
    length)."""

    body = png()
    disconnected = threading.Event()

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.path == "/cat.png":
            self._reply(200, self.body)
        elif self.path == "/text":
            self._reply(200, b"<html>an admin page</html>")
        elif self.path.startswith("/to?"):
            self.send_response(302)
            self.send_header("Location", self.path[4:])
            self.end_headers()
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            try:
                for byte in self.body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                Images.disconnected.set()
        elif self.path == "/endless":
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass
        else:
            self._reply(404, b"no")

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def images():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://localhost:{server.server_address[1]}"
    server.shutdown()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LOCAL = FetchPolicy(frozenset({"localhost"}), timeout_s=3.0, max_bytes=1 << 20)


OPEN = FetchPolicy()  # the default: any host that resolves only to global addresses


def refused(url: str, policy: FetchPolicy = OPEN) -> str:
    with pytest.raises(FetchRefused) as info:
        asyncio.run(fetch(url, policy))
    return str(info.value)


@pytest.mark.parametrize(
    "spelling",
    ["127.0.0.1", "2130706433", "127.1", "0x7f000001", "localhost", "[::ffff:127.0.0.1]"],
)
def test_loopback_in_any_spelling_is_never_connected_to(spelling):
    canary = Canary()
    reason = refused(f"http://{spelling}:{canary.port}/cat.png")
    assert "not a global address" in reason and canary.connections == 0


def test_ipv6_loopback_and_the_metadata_address_are_refused_before_connecting():
    canary = Canary(socket.AF_INET6, "::1")
    assert "not a global address" in refused(f"http://[::1]:{canary.port}/")
    assert canary.connections == 0
    for host in ("169.254.169.254", "10.0.0.1", "[fd00::1]", "[2002:7f00:1::]", "0.0.0.0"):
        assert "not a global address" in refused(f"http://{host}/latest/meta-data/")


def test_a_redirect_is_checked_again_at_every_hop(images):
    assert asyncio.run(fetch(f"{images}/to?/cat.png", LOCAL)) == Images.body  # a local hop
    canary = Canary()
    target = f"http://127.0.0.1:{canary.port}/cat.png"  # a host the operator did not name
    assert "not in --allowed-media-domains" in refused(f"{images}/to?{target}", LOCAL)
    open_policy = FetchPolicy(frozenset(), timeout_s=3.0)  # and without the list: not global
    assert "not a global address" in refused(f"{images}/to?{target}", open_policy)
    assert canary.connections == 0


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost/a\r\nX-Injected: 1",
        "http://localhost/a\x00b",
        "http://user:pass@localhost/cat.png",
        "ftp://localhost/cat.png",
        "http:///cat.png",
    ],
)
def test_urls_that_could_smuggle_or_hide_something_are_refused(url):
    refused(url, LOCAL)


def test_a_slow_server_gets_one_deadline_for_the_whole_fetch(images):
    start = time.monotonic()
    assert "within 1.5s" in refused(f"{images}/slow", FetchPolicy(frozenset({"localhost"}), 1.5))
    assert time.monotonic() - start < 3.0  # a byte every 0.5 s never resets it


def test_the_size_cap_holds_while_reading_a_body_of_no_declared_length(images):
    assert f"more than {1 << 20} bytes" in refused(f"{images}/endless", LOCAL)


def declares_50000_squared() -> bytes:
    """A 1-pixel PNG whose header (IHDR, its CRC fixed) says 50000 x 50000."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    header = bytearray(buffer.getvalue())
    header[16:24] = (50000).to_bytes(4, "big") * 2
    header[29:33] = zlib.crc32(bytes(header[12:29])).to_bytes(4, "big")
    return bytes(header)


def test_decoding_is_bounded_by_the_processors_pixel_budget():
    processor = MiniMaxM3ImageProcessor(ImageProcessorConfig(min_pixels=64, max_pixels=1024))
    with pytest.raises(ValueError, match="pixels"):
        processor(declares_50000_squared())
    big = Image.new("RGB", (8192, 8192))  # 64 Mi pixels, a few hundred KB of PNG
    buffer = io.BytesIO()
    big.save(buffer, format="PNG")
    start = time.monotonic()
    with pytest.raises(ValueError, match="outside 1..4194304 pixels"):
        processor(buffer.getvalue())
    assert time.monotonic() - start < 0.5  # refused from its header, never decoded
    photo = io.BytesIO()  # a JPEG over the budget decodes at a reduced scale instead
    Image.new("RGB", (4096, 3072), (200, 100, 50)).save(photo, format="JPEG")
    image = processor(photo.getvalue())
    assert image.num_tokens > 0 and image.pixels.shape[0] == 3


# ---- through a server ------------------------------------------------------------------------


def no_slot_held(url: str) -> bool:
    report = httpx.get(url + "/kv_cache", timeout=30).json()  # (check_integrity() runs too)
    managers = [v for v in report.values() if isinstance(v, dict)]
    in_use = sum(m["used"] + m["live_requests"] for m in managers)
    return in_use + report["active_requests"] + report["held_for_transfer"] == 0


def ask(url: str) -> dict:
    return {
        "max_tokens": 2,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }


@pytest.fixture(scope="module")
def server(vl_server):
    openai_server, url, _ = vl_server
    openai_server.media = MediaPool(
        MediaOptions(allowed_media_domains=frozenset({"localhost"}), fetch_timeout_s=3, max_jobs=2)
    )
    return openai_server, url


def test_every_fetch_failure_gets_the_same_answer(server, images):
    _, url = server
    canary = Canary()
    answers = set()
    for image_url in (
        f"http://127.0.0.1:{canary.port}/cat.png",  # not allowed
        f"http://2130706433:{canary.port}/cat.png",
        f"{images}/missing.png",  # a 404
        f"{images}/endless",  # too large
        f"http://localhost:{closed_port()}/cat.png",  # refused connection
        f"{images}/to?/to?/to?/to?/to?/to?/cat.png",  # too many redirects
        "http://localhost/a\r\nX: 1",
        "http://localhost/a\x00b",
        f"{images}/to?data:text/plain,hi",  # a redirect to another scheme
        f"{images}/text",  # not an image once fetched
    ):
        reply = httpx.post(url + "/v1/chat/completions", json=ask(image_url), timeout=30)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "messages.0.content.1"
        answers.add(error["message"])
    assert answers == {f"messages.0.content.1: {UNFETCHABLE}"} and canary.connections == 0
    reply = httpx.post(url + "/v1/chat/completions", json=ask(f"{images}/cat.png"), timeout=30)
    assert reply.status_code == 200, reply.text
    assert no_slot_held(url)


def test_slow_image_servers_fill_only_the_media_pool_and_leave_when_their_clients_do(
    server, images
):
    _, url = server
    Images.disconnected.clear()
    with ThreadPoolExecutor(4) as pool:
        clients = [
            pool.submit(httpx.post, url + "/v1/chat/completions", json=ask(f"{images}/slow"),
                        timeout=0.8)
            for _ in range(2)
        ]  # fmt: skip
        time.sleep(0.3)
        reply = httpx.post(url + "/v1/chat/completions", json=ask(f"{images}/cat.png"), timeout=30)
        assert reply.status_code == 503 and "retry later" in reply.json()["error"]["message"]
        text = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=5,
        )
        assert text.status_code == 200  # chats and completions go on meanwhile
        for client in clients:
            with pytest.raises(httpx.ReadTimeout):
                client.result()  # the clients leave after 0.8 s
    assert Images.disconnected.wait(timeout=3)  # and their fetches are cancelled
    deadline = time.monotonic() + 5
    while server[0].media.num_jobs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server[0].media.num_jobs == 0
    reply = httpx.post(url + "/v1/chat/completions", json=ask(f"{images}/cat.png"), timeout=30)
    assert reply.status_code == 200 and no_slot_held(url)


@pytest.mark.parametrize("path", ["/a\x00b.png", "/\x00"])
def test_a_nul_in_a_file_path_is_a_400(server, path):
    _, url = server
    reply = httpx.post(url + "/v1/chat/completions", json=ask("file://" + path), timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages.0.content.1"


def test_decompression_bombs_are_400s_naming_the_part(server):
    _, url = server
    big = io.BytesIO()
    Image.new("RGB", (8192, 8192)).save(big, format="PNG")
    for data in (big.getvalue(), declares_50000_squared()):
        body = ask("data:image/png;base64," + base64.b64encode(data).decode())
        body["messages"][0]["content"] *= 8  # 8 images of 64 Mi pixels, or 2.5 Gi declared
        start = time.monotonic()
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        error = reply.json()["error"]
        assert reply.status_code == 400 and "pixels" in error["message"]
        assert error["param"] == "messages.0.content.1" and time.monotonic() - start < 5
    assert no_slot_held(url)
