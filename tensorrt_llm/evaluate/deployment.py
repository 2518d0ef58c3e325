"""A real disaggregated deployment on this machine (router, context server, generation server, each
its own ``trtllm-serve`` process on loopback), and the evaluation tasks driven through it."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deployment_env() -> dict[str, str]:
    """The servers' environment: this one, with a fresh ``TRTLLM_DISAGG_SECRET`` if none is set
    (the router and the servers of one deployment share it)."""
    secret = os.environ.get("TRTLLM_DISAGG_SECRET") or secrets.token_hex(16)
    return {**os.environ, "TRTLLM_DISAGG_SECRET": secret}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy in {timeout}s")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@contextlib.contextmanager
def disaggregated_deployment(
    options: dict, device: str = "cpu", log_dir: Path | None = None
) -> Iterator[dict]:
    """Start a context server and a generation server (``options`` plus a NIXL transceiver) and a
    router; yields their URLs ``{"router", "ctx", "gen"}`` and stops them all on exit."""
    with contextlib.ExitStack() as stack:
        tmp = Path(log_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        worker = {**options, "cache_transceiver_config": {"backend": "NIXL"}}
        (tmp / "worker.yaml").write_text(yaml.safe_dump(worker))
        ports = {name: free_port() for name in ("ctx", "gen", "router")}
        (tmp / "disagg.yaml").write_text(
            yaml.safe_dump(
                {
                    "hostname": "127.0.0.1",
                    "port": ports["router"],
                    "context_servers": {"urls": [f"127.0.0.1:{ports['ctx']}"]},
                    "generation_servers": {"urls": [f"127.0.0.1:{ports['gen']}"]},
                }
            )
        )
        serve = [sys.executable, "-m", "tensorrt_llm.commands.serve"]
        commands = {
            name: serve
            + ["--config", str(tmp / "worker.yaml"), "--device", device, "--port", str(ports[name])]
            for name in ("ctx", "gen")
        }
        commands["router"] = serve + ["disaggregated", "-c", str(tmp / "disagg.yaml")]
        env = deployment_env()
        procs = {}
        try:
            for name, command in commands.items():
                log = stack.enter_context(open(tmp / f"{name}.log", "w"))
                procs[name] = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env
                )
            urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
            for name in ("ctx", "gen", "router"):
                wait_healthy(urls[name], procs[name])
            yield urls
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(timeout=30)


def chat_many(
    url: str, conversations: list[list[dict]], max_tokens: int = 128, workers: int = 16
) -> list[dict]:
    """Greedy chat completions, sent concurrently (so the servers batch them); replies in order."""
    with httpx.Client(timeout=600) as client:

        def one(messages):
            reply = client.post(
                url + "/v1/chat/completions",
                json={"messages": messages, "temperature": 0, "max_tokens": max_tokens},
            )
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            return {
                "text": choice["message"]["content"],
                "al": choice.get("avg_decoded_tokens_per_iter") or 1.0,
            }

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, conversations))
