"""One GPU against parallel layouts: decode step and throughput of the M3-shaped benchmark model.

The layouts (``--layouts``, ``bench_common.parallel_options``): ``tp1`` (one rank, the
reference), ``tp2`` (tensor parallel: the experts' intermediate split, MoE TP2), ``tp2-ep2`` (tensor-
parallel attention, each rank half the experts: EP2) and ``adp2-ep2`` (attention DP, each rank
half the experts, tokens exchanged by all-to-all: EP2).

The same seeded random model and drafter as ``bench_decode.py`` (whose cells this script runs), for
each layout, mode and batch: an ``LLM`` of the layout's ranks (rank 0 in this process, the others
spawned), warmed up, then ``batch`` random prompts decoded greedily with every ``executor.step()``
of rank 0 timed (a step spans every rank: the ranks meet in each layer's all-reduce, or in each MoE
layer's all-to-all). The ratios printed per mode and batch are each layout's step / the first
layout's (below 1: faster) and its tokens/s / the first layout's, all from this one run.

Also checks the layouts decode alike, on 64 greedy tokens after each of a few random prompts
(the first layout's tokens are the reference):

- free-running agreement: the fraction of positions where a layout's greedy tokens equal TP1's.
  One flipped near-tie (bf16 sums in another order) changes everything after it, and a random
  model's logits are nearly flat, so this understates how close the layouts are;
- teacher-forced agreement: after each prompt plus TP1's first k tokens, for every k < 64, the
  layout's next greedy token (a prefill) against TP1's token k (a decode). TP1 against itself is
  the floor set by prefill and decode summing in different orders;
- layout agreement: the same teacher-forced prefills, TP2's next tokens against TP1's: the
  layouts compared on the same path, and the relative RMS difference of their logits;
- decisive agreement: the layout agreement over the positions where TP1's top token leads its
  runner-up by more than four times the RMS difference of the two layouts' logits (so no
  rounding difference of that size could flip it), and the share of positions that are decisive.
  A wrong shard fails here; a flipped near-tie does not count.

    python benchmarks/bench_multi_gpu.py [--layouts tp1,tp2,tp2-ep2,adp2-ep2] [--batches 1,16,64]
        [--modes target,unified]
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
from bench_common import MLPS, machine_name, parallel_options
from bench_decode import SCALE_DEFAULTS, Cell, Settings, random_prompts, run_cell, write_checkpoints

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.checkpoint import load_config
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.llmapi.llm_args import default_attn_backend
from tensorrt_llm.logger import logger

AGREEMENT_TOKENS = 64


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--scale", default="full", choices=sorted(SCALE_DEFAULTS))
    parser.add_argument(
        "--mlp", default="moe", choices=MLPS, help="dense: every MLP dense (bench_common.py)"
    )
    parser.add_argument(
        "--layouts",
        default="tp1,tp2,tp2-ep2,adp2-ep2",
        help="comma-separated, the first the reference: tp<N>, adp<N>, tp<N>-ep<M>, adp<N>-ep<M>",
    )
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--modes", default="target,unified", help="of target, unified, separate")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument("--agreement-prompts", type=int, default=8)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bf16 on CUDA")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.layouts = args.layouts.split(",")
    for layout in args.layouts:
        parallel_options(layout)  # a bad name fails here
    args.batches = [int(b) for b in args.batches.split(",") if b]  # "": agreement only
    args.modes = args.modes.split(",")
    prompt_len, new_tokens, _, _ = SCALE_DEFAULTS[args.scale]
    backend = default_attn_backend(args.device)
    settings = Settings(
        scale=args.scale,
        device=args.device,
        dtype=args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        attn_backend=backend,
        cuda_graphs=backend == "TRITON",
        prompt_len=args.prompt_len or prompt_len,
        new_tokens=args.new_tokens or new_tokens,
        max_draft_len=3,
        max_num_tokens=8192,
        max_seconds=args.max_seconds,
        seed=0,
        mlp=args.mlp,
    )
    return settings, args


@dataclasses.dataclass
class Decodes:
    """One layout's greedy decode after the prompts, and its teacher-forced next tokens/logits."""

    tokens: list[list[int]]
    forced_tokens: list[int]
    forced_logits: torch.Tensor  # [num_forced, vocab], float32


def decode(
    target_dir: Path, s: Settings, prompts: list[list[int]], reference: list[list[int]] | None
) -> Decodes:
    """Greedy tokens after ``prompts``, then the next token after every prompt + ``reference``
    prefix (``reference``: TP1's tokens; this layout's own when None)."""
    batch = 32
    blocks = -(-(s.prompt_len + AGREEMENT_TOKENS + 8) // 128)
    llm = LLM(
        target_dir,
        kv_cache_config=KvCacheConfig(max_tokens=(batch * blocks + 1) * 128),
        max_batch_size=batch,
        max_seq_len=s.prompt_len + AGREEMENT_TOKENS + 1,
        dtype=s.dtype,
        device=s.device,
        **parallel_options(s.parallel),
    )
    try:
        params = SamplingParams(
            max_tokens=AGREEMENT_TOKENS, ignore_eos=True, temperature=0, detokenize=False
        )
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        reference = reference or tokens
        forced = [p + ref[:k] for p, ref in zip(prompts, reference) for k in range(len(ref))]
        one = SamplingParams(
            max_tokens=1,
            ignore_eos=True,
            temperature=0,
            detokenize=False,
            return_generation_logits=True,
        )
        outputs = [o.outputs[0] for o in llm.generate(forced, one)]
    finally:
        llm.shutdown()
    return Decodes(
        tokens,
        [o.token_ids[0] for o in outputs],
        torch.cat([o.generation_logits.float() for o in outputs]),
    )


def share_equal(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def agreement(base: Decodes, other: Decodes) -> dict[str, float]:
    """``other`` against the reference layout's ``base`` (see the module docstring)."""
    reference = [t for tokens in base.tokens for t in tokens]
    diff = other.forced_logits - base.forced_logits
    top = base.forced_logits.topk(2, dim=-1).values
    decisive = (top[:, 0] - top[:, 1] > 4 * diff.pow(2).mean().sqrt()).tolist()
    pairs = zip(other.forced_tokens, base.forced_tokens, decisive, strict=True)
    kept = [(a, b) for a, b, d in pairs if d]
    return {
        "free_running": share_equal([t for ts in other.tokens for t in ts], reference),
        "teacher_forced": share_equal(other.forced_tokens, reference),
        "layout": share_equal(other.forced_tokens, base.forced_tokens),
        "logits_relative_rms": float(diff.norm() / base.forced_logits.norm()),
        "decisive": share_equal(*zip(*kept)) if kept else 1.0,
        "decisive_share": len(kept) / len(decisive),
    }


def main(argv: list[str] | None = None) -> dict:
    s, args = parse_args(argv)
    logger.set_level("warning")
    started = time.perf_counter()
    cells: dict[tuple[str, str, int], Cell] = {}
    agreements: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_multi_gpu_") as tmp:
        target_dir, draft_dir = write_checkpoints(Path(tmp), s)
        vocab = load_config(target_dir).vocab_size
        prompts = random_prompts(args.agreement_prompts, s.prompt_len, vocab, s.seed + 11)
        decodes: dict[str, Decodes] = {}
        first = args.layouts[0]
        for layout in args.layouts:
            ls = dataclasses.replace(s, parallel=layout)
            base = decodes.get(first)
            decodes[layout] = decode(target_dir, ls, prompts, base.tokens if base else None)
            agreements[layout] = agreement(decodes[first], decodes[layout])
            for batch in args.batches:
                for mode in args.modes:
                    cells[layout, mode, batch] = cell = run_cell(
                        target_dir, draft_dir, mode, batch, ls
                    )
                    print(
                        f"[{time.perf_counter() - started:6.1f} s] {layout} {mode} batch {batch}: "
                        f"step {cell.decode_step_ms:.2f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    return report(cells, agreements, s, args)


def report(cells, agreements, s: Settings, args) -> dict:
    first = args.layouts[0]
    print(
        f"{', '.join(args.layouts)}, random published-M3 model ({s.scale}, {s.mlp} MLPs), "
        f"{s.dtype}, {s.attn_backend}, cuda graphs {'on' if s.cuda_graphs else 'off'} (off under "
        f"adp-ep), prompt {s.prompt_len} + {s.new_tokens} new tokens; machine: "
        f"{machine_name(s.device)} x {torch.cuda.device_count() if s.device == 'cuda' else 1}"
    )
    print(
        f"{'layout':<9} {'mode':<9} {'batch':>5} {'prefill s':>9} {'step ms':>9} {'tokens/s':>10}"
    )
    order = {layout: i for i, layout in enumerate(args.layouts)}
    for (layout, mode, batch), c in sorted(
        cells.items(), key=lambda kv: (order[kv[0][0]], kv[0][1:])
    ):
        print(
            f"{layout:<9} {mode:<9} {batch:>5} {c.prefill_s:>9.2f} {c.decode_step_ms:>9.2f} "
            f"{c.decode_tokens_per_s:>10.1f}"
        )
    lines = []
    for layout in args.layouts[1:]:
        for mode in args.modes:
            for batch in args.batches:
                a, b = cells.get((first, mode, batch)), cells.get((layout, mode, batch))
                if a is not None and b is not None:
                    lines.append(
                        f"{mode} batch {batch}: {layout} / {first} step = "
                        f"{b.decode_step_ms / a.decode_step_ms:.2f}, tokens/s = "
                        f"{b.decode_tokens_per_s / a.decode_tokens_per_s:.2f}"
                    )
    for layout, a in agreements.items():
        lines.append(
            f"{layout} vs {first}, {AGREEMENT_TOKENS} greedy tokens after "
            f"{args.agreement_prompts} prompts: free-running {a['free_running']:.4f}, "
            f"teacher-forced {a['teacher_forced']:.4f}, layout {a['layout']:.4f} (logits "
            f"relative RMS {a['logits_relative_rms']:.2e}), decisive {a['decisive']:.4f} on "
            f"{a['decisive_share']:.1%} of positions"
        )
    for line in lines:
        print(line)
    record = {
        "settings": dataclasses.asdict(s),
        "cells": [
            {"layout": layout, **dataclasses.asdict(c)} for (layout, _, _), c in cells.items()
        ],
        "agreement": agreements,
        "summary": lines,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
