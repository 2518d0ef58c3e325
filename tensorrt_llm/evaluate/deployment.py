"""A real disaggregated deployment on this machine (router, context server, generation server, each
its own ``trtllm-serve`` process on loopback), and the evaluation tasks driven through it."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

from tensorrt_llm.ports import free_port


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


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (from /proc): a server and its engine core's process."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            with open(f"/proc/{p}/task/{task}/children") as f:
                todo += [int(c) for c in f.read().split()]
    return out


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


SERVE = [sys.executable, "-m", "tensorrt_llm.commands.serve"]


class Deployment:
    """``trtllm-serve`` processes on loopback, by name, logging to ``workdir/<name>.log``: start,
    kill (SIGKILL, as a crash), restart on the same port, stop them all."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.env = env or deployment_env()
        self.ports: dict[str, int] = {}
        self.urls: dict[str, str] = {}
        self.commands: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.envs: dict[str, dict[str, str]] = {}  # per process, over ``env``

    def reserve(self, *names: str) -> None:
        """Pick ports for servers that must know each other's (the router's config)."""
        for name in names:
            self.ports[name] = free_port()
            self.urls[name] = f"http://127.0.0.1:{self.ports[name]}"

    def write_yaml(self, filename: str, data: dict) -> Path:
        path = self.workdir / filename
        path.write_text(yaml.safe_dump(data))
        return path

    def server(
        self,
        name: str,
        options: dict,
        device: str = "cpu",
        gpus: str | None = None,
        flags: list[str] = (),
    ) -> None:
        """A model server with LLM ``options`` (the bundled model when they name none), on the
        GPUs ``gpus`` (``CUDA_VISIBLE_DEVICES``, e.g. "1") when given, with more ``trtllm-serve``
        ``flags`` (``--reasoning_parser minimax_m3``)."""
        config = self.write_yaml(f"{name}.yaml", options)
        if gpus is not None:
            self.envs[name] = {"CUDA_VISIBLE_DEVICES": gpus}
        self.start(name, ["--config", str(config), "--device", device, *flags])

    def router(self, name: str, context: list[str], generation: list[str]) -> None:
        """A disaggregated router in front of the named servers."""
        if name not in self.ports:
            self.reserve(name)
        config = self.write_yaml(
            f"{name}.yaml",
            {
                "hostname": "127.0.0.1",
                "port": self.ports[name],
                "context_servers": {
                    "urls": [self.urls[n].removeprefix("http://") for n in context]
                },
                "generation_servers": {
                    "urls": [self.urls[n].removeprefix("http://") for n in generation]
                },
            },
        )
        self.start(name, ["disaggregated", "-c", str(config)], port_flag=False)

    def start(self, name: str, args: list[str], port_flag: bool = True) -> None:
        if name not in self.ports:
            self.reserve(name)
        self.commands[name] = (
            SERVE + args + (["--port", str(self.ports[name])] if port_flag else [])
        )
        self._launch(name)

    def _launch(self, name: str) -> None:
        with open(self.workdir / f"{name}.log", "a") as log:
            self.procs[name] = subprocess.Popen(
                self.commands[name],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **self.envs.get(name, {})},
            )

    def wait_healthy(self, *names: str) -> None:
        for name in names or tuple(self.procs):
            wait_healthy(self.urls[name], self.procs[name])

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait(timeout=30)

    def restart(self, name: str) -> None:
        """Start ``name`` again with the same command and port, and wait until it is healthy."""
        if self.procs[name].poll() is None:
            self.kill(name)
        self._launch(name)
        self.wait_healthy(name)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def running(workdir: Path | None = None) -> Iterator[Deployment]:
    """A ``Deployment`` whose processes are all stopped on exit."""
    with contextlib.ExitStack() as stack:
        tmp = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        deployment = Deployment(tmp)
        try:
            yield deployment
        finally:
            deployment.stop()


def disaggregation_options(options: dict, **transceiver) -> dict:
    """``options`` of a context or generation server: plus a NIXL transceiver."""
    return {**options, "cache_transceiver_config": {"backend": "NIXL", **transceiver}}


@contextlib.contextmanager
def disaggregated_deployment(
    options: dict,
    device: str = "cpu",
    log_dir: Path | None = None,
    gpus: tuple[str | None, str | None] = (None, None),
    layouts: tuple[dict, dict] = ({}, {}),
) -> Iterator[dict]:
    """Start a context server and a generation server (``options`` plus a NIXL transceiver, plus
    ``layouts[0]`` and ``layouts[1]``, e.g. ``{"tensor_parallel_size": 2}``; on the GPUs
    ``gpus[0]`` and ``gpus[1]`` when given, e.g. "0,1") and a router; yields their URLs
    ``{"router", "ctx", "gen"}`` and stops them all on exit."""
    with running(log_dir) as deployment:
        deployment.reserve("ctx", "gen", "router")
        for name, on, layout in zip(("ctx", "gen"), gpus, layouts, strict=True):
            deployment.server(name, disaggregation_options({**options, **layout}), device, on)
        deployment.router("router", ["ctx"], ["gen"])
        deployment.wait_healthy("ctx", "gen", "router")
        yield deployment.urls


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
