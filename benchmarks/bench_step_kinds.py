"""Where the engine's time goes at a concurrency level: each step timed and classed as a CUDA graph
replay or an eager step (prefill, or prefill mixed into decodes), for ``LLM.generate`` in batches
and for ``LLM.submit`` with the level's number in flight (requests arriving one by one, as a
server's do).

    python benchmarks/bench_step_kinds.py [--device cuda] [--concurrency 16] [--num-requests 192]

The README's model and ``bench_serving.py``'s workload; one untimed pass of each first. Each step
is synchronised to time it, so the totals run a little slower than ``bench_serving.py``'s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from bench_common import machine_name
from bench_serving import engine_level, generate_level

from tensorrt_llm.bench.serving import Workload
from tensorrt_llm.bundled import bundled_eagle3
from tensorrt_llm.llmapi import LLM
from tensorrt_llm.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=192)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    print(f"machine: {machine_name(args.device)}", flush=True)
    level = args.concurrency
    llm = LLM(speculative_config=bundled_eagle3(), max_batch_size=level, device=args.device)
    bodies = Workload("gsm8k", args.num_requests, output_len=args.output_len).requests()
    template, encode = llm.tokenizer.apply_chat_template, llm.tokenizer.encode
    prompts = [encode(template(b["messages"])) for b in bodies]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    generate_level(llm, prompts, params, level)
    engine_level(llm, prompts, params, level)
    executor, runner = llm.rank_executor, llm.rank_executor.cuda_graph_runner
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = defaultdict(list)
    step = executor.step

    def timed_step():
        replays = runner.num_replays if runner is not None else 0
        sync()
        start = time.perf_counter()
        finished = step()
        sync()
        kind = "graph" if runner is not None and runner.num_replays > replays else "eager"
        times[kind].append(time.perf_counter() - start)
        return finished

    executor.step = timed_step
    print(
        "| path | tokens/s | kind | steps | median ms | total s |\n| --- | --- | --- | --- | --- | --- |"
    )
    for name, run in (("generate", generate_level), ("submit", engine_level)):
        times.clear()
        tokens_per_s = run(llm, prompts, params, level)["output_tokens_per_s"]
        for kind, spent in sorted(times.items()):
            print(
                f"| {name} | {tokens_per_s:.0f} | {kind} | {len(spent)} "
                f"| {1000 * statistics.median(spent):.2f} | {sum(spent):.2f} |"
            )
    llm.shutdown()


if __name__ == "__main__":
    main()
