"""The server front's CPU per output token: this tree against another commit, in one run.

    python benchmarks/bench_front.py --against REF [--device cpu|cuda] [--concurrency 16]
        [--num-requests 128] [--rounds 3] [--client-processes 2]

``REF`` (a commit, a branch, ``HEAD~1``) is checked out in a temporary git worktree; each round
starts ``trtllm-serve`` once from it and once from this tree (that folder first on the server's
``PYTHONPATH``), in alternating order, on the README's model and workload (as
``bench_http_stack.py``: one untimed pass of 32 requests, then the level), and takes the front
process's CPU seconds over the level (all its threads) per output token. Printed: each run, each
tree's median and this tree's / REF's. The front's work is what a change to the HTTP handlers, the
streams, the detokenizing or the trip to the engine core moves; the engine's speed moves the
tokens/s, not this figure.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench_common import machine_name, streamed_chat_bodies
from bench_http_stack import front_cpu_per_token

ROOT = Path(__file__).resolve().parents[1]


def worktree(ref: str, folder: Path) -> Path:
    """``ref`` checked out (detached) in ``folder``."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(folder), ref],
        check=True,
    )
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="the git commit to compare with")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--client-processes", type=int, default=2)
    args = p.parse_args()
    bodies = streamed_chat_bodies(args.num_requests, args.output_len)
    print(f"machine: {machine_name(args.device)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-front-") as folder:
        other = worktree(args.against, Path(folder) / "ref")
        trees = {"this tree": str(ROOT), args.against: str(other)}
        figures: dict[str, list[float]] = {name: [] for name in trees}
        try:
            for round_ in range(args.rounds):
                order = list(trees.items())
                for name, path in order if round_ % 2 == 0 else order[::-1]:
                    us, tok = front_cpu_per_token(args, bodies, path)
                    figures[name].append(us)
                    print(f"  round {round_ + 1}, {name}: {us:.1f} µs/token, {tok:.0f} tokens/s")
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False
            )
    base = statistics.median(figures[args.against])
    print("\n| tree | front CPU µs per output token (median) | / REF |\n| --- | --- | --- |")
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
