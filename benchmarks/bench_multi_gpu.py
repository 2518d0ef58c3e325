"""TP1 against TP2: decode step and throughput of the M3-shaped benchmark model on one and two GPUs.

The same seeded random model and drafter as ``bench_decode.py`` (whose cells this script runs), for
each tensor-parallel size, mode and batch: an ``LLM`` with ``tensor_parallel_size`` ranks (rank 0
in this process, the others spawned), warmed up, then ``batch`` random prompts decoded greedily
with every ``executor.step()`` of rank 0 timed (a step spans every rank: the ranks meet in each
layer's all-reduce). The ratio printed per mode and batch is TP2 step / TP1 step (below 1: TP2 is
faster) and TP2 tokens/s / TP1 tokens/s, both from this one run.

Also checks the two layouts decode alike: the greedy tokens of TP1 and TP2 on the same prompts,
as the fraction of the first 64 positions where they agree (bf16: summation order differs between
the layouts, so near-ties may flip).

    python benchmarks/bench_multi_gpu.py [--tp 1,2] [--batches 1,16,64] [--modes target,unified]
    python benchmarks/bench_multi_gpu.py --device cpu --scale tiny --batches 1,2 --new-tokens 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import machine_name
from bench_decode import SCALE_DEFAULTS, Cell, Settings, random_prompts, run_cell, write_checkpoints

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.llmapi.llm_args import default_attn_backend
from tensorrt_llm.logger import logger

AGREEMENT_TOKENS = 64


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--scale", default="full", choices=sorted(SCALE_DEFAULTS))
    parser.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--modes", default="target,unified", help="of target, unified, separate")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument("--agreement-prompts", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.tp = [int(t) for t in args.tp.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = args.modes.split(",")
    prompt_len, new_tokens, _, _ = SCALE_DEFAULTS[args.scale]
    backend = default_attn_backend(args.device)
    settings = Settings(
        scale=args.scale,
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        attn_backend=backend,
        cuda_graphs=backend == "TRITON",
        prompt_len=args.prompt_len or prompt_len,
        new_tokens=args.new_tokens or new_tokens,
        max_draft_len=3,
        max_num_tokens=8192,
        max_seconds=args.max_seconds,
        seed=0,
    )
    return settings, args


def greedy_tokens(target_dir: Path, s: Settings, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(
        target_dir,
        kv_cache_config=KvCacheConfig(max_tokens=len(prompts) * 128 * 8),
        max_batch_size=len(prompts),
        max_seq_len=s.prompt_len + AGREEMENT_TOKENS,
        dtype=s.dtype,
        device=s.device,
        tensor_parallel_size=s.tp_size,
    )
    try:
        params = SamplingParams(max_tokens=AGREEMENT_TOKENS, ignore_eos=True, detokenize=False)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions (over every prompt) where the two decodes hold the same token."""
    pairs = [(x, y) for ta, tb in zip(a, b) for x, y in zip(ta, tb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def main(argv: list[str] | None = None) -> dict:
    s, args = parse_args(argv)
    logger.set_level("warning")
    started = time.perf_counter()
    cells: dict[tuple[int, str, int], Cell] = {}
    tokens: dict[int, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_multi_gpu_") as tmp:
        target_dir, draft_dir = write_checkpoints(Path(tmp), s)
        for tp in args.tp:
            ts = dataclasses.replace(s, tp_size=tp)
            vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
            prompts = random_prompts(args.agreement_prompts, s.prompt_len, vocab, s.seed + 11)
            tokens[tp] = greedy_tokens(target_dir, ts, prompts)
            for batch in args.batches:
                for mode in args.modes:
                    cells[tp, mode, batch] = cell = run_cell(target_dir, draft_dir, mode, batch, ts)
                    print(
                        f"[{time.perf_counter() - started:6.1f} s] tp{tp} {mode} batch {batch}: "
                        f"step {cell.decode_step_ms:.2f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    return report(cells, tokens, s, args)


def report(cells, tokens, s: Settings, args) -> dict:
    print(
        f"TP1 vs TP2, M3-shaped random model ({s.scale}), {s.dtype}, {s.attn_backend}, "
        f"cuda graphs {'on' if s.cuda_graphs else 'off'}, prompt {s.prompt_len} + "
        f"{s.new_tokens} new tokens; machine: {machine_name(s.device)} x "
        f"{torch.cuda.device_count() if s.device == 'cuda' else 1}"
    )
    print(f"{'tp':>3} {'mode':<9} {'batch':>5} {'prefill s':>9} {'step ms':>9} {'tokens/s':>10}")
    for (tp, mode, batch), c in sorted(cells.items()):
        print(
            f"{tp:>3} {mode:<9} {batch:>5} {c.prefill_s:>9.2f} {c.decode_step_ms:>9.2f} "
            f"{c.decode_tokens_per_s:>10.1f}"
        )
    lines = []
    base, other = min(args.tp), max(args.tp)
    for mode in args.modes:
        for batch in args.batches:
            a, b = cells.get((base, mode, batch)), cells.get((other, mode, batch))
            if a is not None and b is not None and base != other:
                lines.append(
                    f"{mode} batch {batch}: TP{other} / TP{base} step = "
                    f"{b.decode_step_ms / a.decode_step_ms:.2f}, tokens/s = "
                    f"{b.decode_tokens_per_s / a.decode_tokens_per_s:.2f}"
                )
    if base != other:
        share = agreement(tokens[base], tokens[other])
        lines.append(
            f"greedy token agreement TP{other} vs TP{base}, first {AGREEMENT_TOKENS} tokens of "
            f"{args.agreement_prompts} prompts: {share:.4f}"
        )
    for line in lines:
        print(line)
    record = {
        "settings": dataclasses.asdict(s),
        "cells": [{"tp": tp, **dataclasses.asdict(c)} for (tp, _, _), c in sorted(cells.items())],
        "summary": lines,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
