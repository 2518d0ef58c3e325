"""What one bad or hostile request costs a server: each probe replays an attack on real
``trtllm-serve`` processes (M3-tiny-VL, the bundled model with a vision tower, on the CPU) and
prints what it did to the server and to the requests beside it.

    python benchmarks/bench_server_faults.py [--skip-disaggregated]

Run it from a checkout of any version (the package importable from there, e.g. with ``PYTHONPATH``
set to it) to compare versions: a probe reports only what it measured, and options a version does
not have are left out.

| probe | figures |
| --- | --- |
| poison pill | the pill's status; streams beside it cut (of 3) |
| loopback image URLs | connections a loopback listener got (of 7 URLs: six spellings, one redirect); distinct error texts |
| slow image servers | a text chat's latency while 8 image fetches trickle a byte every 3 s; seconds until a fetch stops once its client left |
| 6 MB prompt | its status and time; the slowest ``/health`` meanwhile |
| chunked 16 MB body | its status and time; the server's resident growth |
| unhandled inputs | answers that are not an OpenAI error object, or are 500s (of 5) |
| many long samples | a 4-token request's latency while ``n=16`` samples of 512 tokens run; the status of ``n=16, max_tokens=10**9`` |
| memory | resident growth after 16 images of 4 Mi pixels, 5 s later |
| frozen context server | the pull's status and time; the slowest gap between tokens of a stream beside it |
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
from bench_common import machine_name
from PIL import Image

from tensorrt_llm.evaluate.deployment import SERVE, disaggregation_options, process_tree, running

ROOT = Path(__file__).resolve().parents[1]
ROWS: list[tuple[str, str]] = []


def report(probe: str, figures: str) -> None:
    ROWS.append((probe, figures))
    print(f"  {probe}: {figures}", flush=True)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def supports(flag: str) -> bool:
    out = subprocess.run([*SERVE, "--help"], capture_output=True, text=True).stdout
    return flag in out


def png(side: int) -> bytes:
    pixels = (np.indices((side, side)).sum(0)[..., None] % 251).astype(np.uint8).repeat(3, -1)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_chat(url: str, n: int = 1, text: str = "what is this?", max_tokens: int = 2) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}}] * n
    content = [{"type": "text", "text": text}, *parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


class Canary:
    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port, self.connections = self.sock.getsockname()[1], 0
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
    """/to?<url> (a redirect), /slow (a byte every 3 s, forever)."""

    closed_at: list[float] = []

    def do_GET(self):  # noqa: N802
        if self.path.startswith("/to?"):
            self.send_response(302)
            self.send_header("Location", self.path[4:])
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"\x89")
                self.wfile.flush()
                readable, _, _ = select.select([self.connection], [], [], 3)
                if readable and not self.connection.recv(1, socket.MSG_PEEK):
                    break  # the fetcher closed the connection
        except OSError:
            pass
        Images.closed_at.append(time.monotonic())

    def log_message(self, *args):
        pass


IMAGES_HOST = "127.0.0.2"  # a loopback address none of the spellings probed names


def image_server() -> str:
    server = ThreadingHTTPServer((IMAGES_HOST, 0), Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{IMAGES_HOST}:{server.server_address[1]}"


def stream_texts(url: str, count: int, max_tokens: int) -> list:
    """``count`` streams of ``max_tokens`` tokens in threads; returns their futures (each: its
    event texts, an error event counted as such)."""

    def one():
        body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    events.append((time.monotonic(), json.loads(line[6:])))
        return events

    pool = ThreadPoolExecutor(count)
    return [pool.submit(one) for _ in range(count)]


def probe_poison(url: str) -> None:
    streams = stream_texts(url, 3, 64)
    time.sleep(1.0)
    raw = '{"prompt": "hi", "top_k": 18446744073709551616, "temperature": 1}'
    reply = httpx.post(
        url + "/v1/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    cut = sum(any("error" in e for _, e in s.result()) for s in streams)
    report("poison pill", f"status {reply.status_code}; streams cut {cut} of 3")


def probe_loopback(url: str, images: str) -> None:
    canary = Canary()
    port = canary.port
    urls = [
        f"http://{host}:{port}/cat.png"
        for host in (
            "127.0.0.1",
            "2130706433",
            "127.1",
            "0x7f000001",
            "localhost",
            "[::ffff:127.0.0.1]",
        )
    ] + [f"{images}/to?http://127.0.0.1:{port}/cat.png"]
    texts = set()
    for image in urls:
        reply = httpx.post(url + "/v1/chat/completions", json=image_chat(image), timeout=60)
        try:
            texts.add(reply.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            texts.add(reply.text[:80])
    report(
        "loopback image URLs",
        f"connections reached {canary.connections} of {len(urls)}; error texts {len(texts)}",
    )


def probe_slow_images(url: str, images: str) -> None:
    Images.closed_at.clear()
    pool = ThreadPoolExecutor(8)
    clients = [
        pool.submit(
            httpx.post, url + "/v1/chat/completions", json=image_chat(f"{images}/slow"), timeout=4
        )
        for _ in range(8)
    ]
    time.sleep(1.0)
    start = time.monotonic()
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code
        latency = f"{time.monotonic() - start:.2f} s (status {status})"
    except httpx.TimeoutException:
        latency = "> 30 s (timed out)"
    for client in clients:
        with contextlib.suppress(httpx.HTTPError):
            client.result()
    left = time.monotonic()
    deadline = left + 20
    while len(Images.closed_at) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    stopped = f"{max(Images.closed_at) - left:.1f} s" if len(Images.closed_at) == 8 else "> 20 s"
    report(
        "slow image servers",
        f"text chat {latency}; fetches stopped after their clients left: {stopped}",
    )


def probe_long_prompt(url: str) -> None:
    worst, stop = [0.0], threading.Event()

    def poll():
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                start = time.monotonic()
                client.get(url + "/health")
                worst[0] = max(worst[0], time.monotonic() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    start = time.monotonic()
    text = "Ann has 58 cups. " * (6 * 2**20 // 17)
    reply = httpx.post(url + "/v1/completions", json={"prompt": text}, timeout=300)
    took = time.monotonic() - start
    stop.set()
    poller.join()
    report(
        "6 MB prompt",
        f"status {reply.status_code} in {took:.2f} s; slowest /health {worst[0]:.2f} s",
    )


def probe_chunked(url: str, pid: int) -> None:
    before = rss_mib(pid)
    host, port = url.removeprefix("http://").split(":")
    body = b'{"prompt": "' + b"a" * (16 * 2**20) + b'"}'
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=300) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        try:
            for i in range(0, len(body), 1 << 20):
                part = body[i : i + (1 << 20)]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        status = sock.recv(64).split(b" ")[1].decode()
    took = time.monotonic() - start
    time.sleep(2)
    report(
        "chunked 16 MB body",
        f"status {status} in {took:.2f} s; resident +{rss_mib(pid) - before:.0f} MiB",
    )


def probe_unhandled(url: str, media: Path) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    bomb = bytearray(buffer.getvalue())
    bomb[16:24] = (50000).to_bytes(4, "big") * 2
    bomb[29:33] = zlib.crc32(bytes(bomb[12:29])).to_bytes(4, "big")
    cases = [
        json.dumps(image_chat("data:image/png;base64," + base64.b64encode(bytes(bomb)).decode())),
        json.dumps(image_chat("http://example.com/a\r\nX: 1")),
        json.dumps(image_chat("http://example.com/a\x00b")),
        json.dumps(image_chat(f"file://{media}/a\x00b.png")),
        '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
    ]
    bad = 0
    for raw in cases:
        reply = httpx.post(
            url + "/v1/chat/completions",
            content=raw,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        try:
            ok = isinstance(reply.json()["error"]["message"], str) and reply.status_code < 500
        except (ValueError, KeyError, TypeError):
            ok = False
        bad += not ok
    report("unhandled inputs", f"plain-text or 500 answers {bad} of {len(cases)}")


def probe_many_samples(url: str) -> None:
    huge = {"prompt": "hi", "n": 16, "max_tokens": 10**9, "ignore_eos": True, "temperature": 1}
    pool = ThreadPoolExecutor(1)
    with httpx.Client(timeout=600) as long_client:
        status = "running"
        try:
            reply = long_client.post(url + "/v1/completions", json=huge, timeout=2)
            status = str(reply.status_code)
        except httpx.TimeoutException:
            status = "accepted (still running after 2 s; cancelled)"
    time.sleep(2)  # (a request whose client left is cancelled within a poll)
    many = {"prompt": "hi", "n": 16, "max_tokens": 512, "ignore_eos": True, "temperature": 1}
    running_long = pool.submit(httpx.post, url + "/v1/completions", json=many, timeout=900)
    time.sleep(2)
    start = time.monotonic()
    try:
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
        latency = f"{time.monotonic() - start:.1f} s"
    except httpx.TimeoutException:
        latency = "> 120 s"
    running_long.result()
    report("many long samples", f"4-token request {latency}; n=16 x 10**9 tokens: {status}")


def probe_memory(url: str, pid: int) -> None:
    small = "data:image/png;base64," + base64.b64encode(png(64)).decode()
    httpx.post(url + "/v1/chat/completions", json=image_chat(small), timeout=120)
    time.sleep(3)
    before = rss_mib(pid)
    large = "data:image/png;base64," + base64.b64encode(png(2000)).decode()
    httpx.post(url + "/v1/chat/completions", json=image_chat(large, n=16), timeout=300)
    peak = rss_mib(pid)
    time.sleep(5)
    report(
        "memory",
        f"resident {before:.0f} -> {peak:.0f} MiB, 5 s later +{rss_mib(pid) - before:.0f} MiB",
    )


def probe_frozen_context(workdir: Path) -> None:
    from tensorrt_llm._torch.disaggregation import trust

    pool = {"kv_cache_config": {"tokens_per_block": 128, "max_tokens": 16 * 128}}
    with running(workdir) as servers:
        servers.reserve("ctx", "gen")
        for name in ("ctx", "gen"):
            servers.server(name, disaggregation_options(pool, transfer_timeout_s=10.0))
        servers.wait_healthy()
        auth = {trust.DISAGG_AUTH_HEADER: servers.env["TRTLLM_DISAGG_SECRET"]}
        chat = {"messages": [{"role": "user", "content": "Ann has 5 cups."}], "max_tokens": 8}
        ask = {**chat, "disaggregated_params": {"request_type": "context_only"}}
        params = httpx.post(
            servers.urls["ctx"] + "/v1/chat/completions", json=ask, headers=auth, timeout=60
        ).json()["disaggregated_params"]
        params["request_type"] = "generation_only"
        beside = stream_texts(servers.urls["gen"], 1, 600)[0]
        time.sleep(1.0)
        frozen = process_tree(servers.procs["ctx"].pid)  # the server and its engine process
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            reply = httpx.post(
                servers.urls["gen"] + "/v1/chat/completions",
                json={**chat, "disaggregated_params": params},
                headers=auth,
                timeout=120,
            )
        finally:
            took = time.monotonic() - start
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        arrivals = [t for t, _ in beside.result()]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if start < b < start + took + 1]
        report(
            "frozen context server",
            f"pull status {reply.status_code} after {took:.1f} s; slowest gap beside it "
            f"{max(gaps, default=float('nan')):.2f} s",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-disaggregated", action="store_true")
    args = parser.parse_args()
    print(
        f"# {machine_name('cpu')}; package from {Path(__import__('tensorrt_llm').__file__).parent}"
    )
    work = Path(tempfile.mkdtemp(prefix="server-faults-"))
    subprocess.run(
        [sys.executable, str(ROOT / "examples/models/make_m3_tiny_vl.py"), str(work / "vl")],
        check=True,
        capture_output=True,
    )
    media = work / "media"
    for folder in (media, work / "logs", work / "disagg"):
        folder.mkdir()
    images = image_server()
    flags = ["--allowed-local-media-path", str(media)]
    if supports("--allowed-media-domains"):  # the slow server is on loopback: named, to reach it
        flags += ["--allowed-media-domains", IMAGES_HOST]
    with running(work / "logs") as servers:
        servers.start("vl", [str(work / "vl/target"), "--device", "cpu", *flags])
        servers.wait_healthy()
        url, pid = servers.urls["vl"], servers.procs["vl"].pid
        for probe, probe_args in (
            (probe_poison, (url,)),
            (probe_loopback, (url, images)),
            (probe_long_prompt, (url,)),
            (probe_chunked, (url, pid)),
            (probe_unhandled, (url, media)),
            (probe_many_samples, (url,)),
            (probe_memory, (url, pid)),
            (probe_slow_images, (url, images)),  # last: a server it stalls may stay stalled
        ):
            try:
                probe(*probe_args)
            except Exception as exc:  # a probe that could not finish says so, the others run
                report(
                    probe.__name__.removeprefix("probe_"), f"failed: {type(exc).__name__}: {exc}"
                )
    if not args.skip_disaggregated:
        probe_frozen_context(work / "disagg")
    print("\n| probe | figures |\n| --- | --- |")
    for probe, figures in ROWS:
        print(f"| {probe} | {figures} |")


if __name__ == "__main__":
    main()
