"""The server front's CPU per output token under each HTTP stack uvicorn can run it on, in one
run: ``h11`` on asyncio's loop (plain ``uvicorn``), ``httptools`` on asyncio's loop, and
``httptools`` on ``uvloop`` (what ``uvicorn[standard]`` and this package install).

    python benchmarks/bench_http_stack.py [--device cpu|cuda] [--concurrency 16]
        [--num-requests 128] [--rounds 2] [--client-processes 2]

uvicorn takes ``httptools`` and ``uvloop`` when it can import them; each stack is chosen by
starting ``trtllm-serve`` with a folder first on its ``PYTHONPATH`` whose stand-ins for the ones
left out fail to import. Per stack and round: one untimed pass of 32 requests, then the level
(the README's model and workload, as ``bench_serving.py``), and the front process's CPU seconds
over it (all its threads, from ``/proc``) divided by the output tokens: the work of the HTTP
server, the streams, the detokenizing and the trip to the engine core per token. Stacks alternate
within each round; printed: each run, then each stack's median and its ratio to ``h11``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import machine_name, streamed_chat_bodies
from bench_serving import thread_cpu_seconds

from tensorrt_llm.bench.serving import run_spread, summarize
from tensorrt_llm.bundled import bundled_eagle3
from tensorrt_llm.evaluate.deployment import running

STACKS = {  # name: the packages hidden from the server
    "h11 + asyncio": ("httptools", "uvloop"),
    "httptools + asyncio": ("uvloop",),
    "httptools + uvloop": (),
}


def hiding(folder: Path, packages: tuple[str, ...]) -> str:
    """A folder whose stand-ins for ``packages`` fail to import (uvicorn then takes its own)."""
    for name in packages:
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name}: left out')\n")
    return str(folder)


def front_cpu_per_token(args, bodies: list[dict], hidden: str) -> tuple[float, float]:
    """One server on the stack ``hidden`` leaves: the front's CPU µs per output token over a
    level, and the level's output tokens/s."""
    saved = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hidden, saved) if p)
    options = {"speculative_config": bundled_eagle3(), "max_batch_size": args.concurrency}
    try:
        with running() as deployment:
            config = deployment.write_yaml("options.yaml", {**options, "device": args.device})
            deployment.start("server", ["--config", str(config), "--device", args.device])
            deployment.wait_healthy("server")
            url = deployment.urls["server"] + "/v1/chat/completions"
            pid = deployment.procs["server"].pid
            level = {"concurrency": args.concurrency, "processes": args.client_processes}
            run_spread(url, bodies[:32], **level)  # (untimed)
            before = thread_cpu_seconds(pid)
            results, wall = run_spread(url, bodies, **level)
            after = thread_cpu_seconds(pid)
    finally:
        os.environ["PYTHONPATH"] = saved
    s = summarize(results, wall)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s['errors']}")
    front = sum(t - before.get(tid, 0.0) for tid, t in after.items())
    tokens = s["output_tokens_per_s"] * wall
    return front / tokens * 1e6, s["output_tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--client-processes", type=int, default=2)
    args = p.parse_args()
    for name in ("httptools", "uvloop"):
        try:
            __import__(name)
        except ImportError:
            sys.exit(f"{name} is not installed here: pip install httptools uvloop")
    bodies = streamed_chat_bodies(args.num_requests, args.output_len)
    print(f"machine: {machine_name(args.device)}", flush=True)
    figures: dict[str, list[float]] = {name: [] for name in STACKS}
    with tempfile.TemporaryDirectory(prefix="http-stack-") as folder:
        for round_ in range(args.rounds):
            for name, hidden in STACKS.items():
                shadow = hiding(Path(folder) / name.replace(" + ", "_"), hidden)
                us, tok = front_cpu_per_token(args, bodies, shadow)
                figures[name].append(us)
                print(f"  round {round_ + 1}, {name}: {us:.1f} µs/token, {tok:.0f} tokens/s")
    base = statistics.median(figures["h11 + asyncio"])
    print(
        "\n| stack | front CPU µs per output token (median) | / h11 + asyncio |\n| --- | --- | --- |"
    )
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
