"""The bundled model's decode speed with each drafter: output tokens/s of ``LLM.generate`` with no
speculation, with the Eagle3 drafter and with the target's own MTP module (both unified), at each
batch size, as ratios to target only measured in one run (under ``--guided``, to target only
under the same schema).

    python benchmarks/bench_drafters.py [--device cuda] [--batches 1,16] [--model DIR]

GSM8K-style chat prompts in the thinking mode the template defaults to, greedy, each request
ending at its own end of turn (the tokens are the same in every mode when speculation is
lossless: the ``same`` column counts the requests whose tokens equal target only's). Every mode
runs one untimed pass at each batch size first (CUDA graph capture, warm-up); then ``--rounds``
timed passes go round the modes in turn, and the median pass is kept. A mode the checkpoint
cannot run (MTP on a target without its module) is skipped with a note.

``--guided``: each mode runs again with every request under a JSON schema (``ANSWER_SCHEMA``:
the answer as an integer; ``disable_any_whitespace`` unless ``--json-whitespace any``) in the
template's disabled thinking mode, as ``<mode>+json`` rows; its free rows use the same prompts,
so the two AL columns compare what the grammar costs a drafter. ``AL max`` is the most the
replies' lengths allow (a reply of n tokens takes at least ``ceil((n - 1) / (K + 1))`` steps
after its first token): a short reply caps it below ``K + 1``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from bench_common import machine_name

from tensorrt_llm.bench.serving import Workload
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.commands.eval import has_mtp_module
from tensorrt_llm.evaluate.runner import mean_al
from tensorrt_llm.llmapi import LLM, KvCacheConfig
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams

MODES = ("target", "eagle3", "mtp")
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": -100, "maximum": 200}},
    "required": ["answer"],
    "additionalProperties": False,
}


def speculative_config(mode: str, draft: Path, k: int) -> dict | None:
    if mode == "eagle3":
        return {"decoding_type": "Eagle3", "speculative_model": str(draft), "max_draft_len": k}
    if mode == "mtp":
        return {"decoding_type": "MTP", "num_nextn_predict_layers": 1, "max_draft_len": k}
    return None


def al_bound(tokens: list[list[int]], k: int) -> float:
    """The most AL replies of these lengths allow with ``k`` drafts a step (the engine's AL:
    tokens after the first over the steps that made them), averaged as ``mean_al``."""
    bounds = [
        (len(t) - 1) / math.ceil((len(t) - 1) / (k + 1)) if len(t) > 1 else 1.0 for t in tokens
    ]
    return sum(bounds) / len(bounds)


def timed_pass(llm: LLM, prompts: list, params: SamplingParams, batch: int) -> dict:
    begin, outputs = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i : i + batch], params)
    seconds = time.perf_counter() - begin
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"seconds": seconds, "tokens": tokens, "al": mean_al(outputs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", type=Path, default=BUNDLED_TARGET)
    p.add_argument("--draft", type=Path, default=BUNDLED_DRAFT, help="the Eagle3 drafter")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--batches", default="1,16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=160, help="max_tokens of every request")
    p.add_argument("--max-draft-len", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--guided", action="store_true", help="also every mode under a JSON schema")
    p.add_argument(
        "--json-whitespace",
        choices=("none", "any"),
        default="none",
        help="--guided's JSON: none between tokens (disable_any_whitespace), or runs of up to 16",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    print(f"machine: {machine_name(args.device)}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if "mtp" in modes and not has_mtp_module(str(args.model)):
        print(f"mtp skipped: {args.model} has no MTP module (num_mtp_modules is 0)")
        modes.remove("mtp")
    llms = {
        mode: LLM(
            model=str(args.model),
            speculative_config=speculative_config(mode, args.draft, args.max_draft_len),
            max_batch_size=max(batches),
            # a pool each, sized for the batch: several engines share the GPU
            kv_cache_config=KvCacheConfig(max_tokens=max(batches) * (args.output_len + 512)),
            guided_decoding_backend="xgrammar" if args.guided else None,
            device=args.device,
        )
        for mode in modes
    }
    bodies = Workload("gsm8k", args.num_requests).requests()
    tokenizer = next(iter(llms.values())).tokenizer
    variables = {"thinking_mode": "disabled"} if args.guided else {}
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(b["messages"], **variables)) for b in bodies
    ]
    free = SamplingParams(max_tokens=args.output_len, temperature=0)
    runs = {mode: (llm, free) for mode, llm in llms.items()}
    if args.guided:
        compact = args.json_whitespace == "none"
        guide = GuidedDecodingParams(json=ANSWER_SCHEMA, disable_any_whitespace=compact)
        guided = SamplingParams(max_tokens=args.output_len, temperature=0, guided_decoding=guide)
        runs |= {f"{mode}+json": (llm, guided) for mode, llm in llms.items()}
    rows = []
    for batch in batches:
        for llm, params in runs.values():
            timed_pass(llm, prompts, params, batch)  # capture and warm-up, untimed
        passes = {mode: [] for mode in runs}
        for _ in range(args.rounds):
            for mode, (llm, params) in runs.items():
                passes[mode].append(timed_pass(llm, prompts, params, batch))
        speeds = {}
        for mode in runs:
            first = f"{modes[0]}+json" if mode.endswith("+json") else modes[0]  # its baseline
            base = passes[first][0]["tokens"]
            kept = sorted(passes[mode], key=lambda r: r["seconds"])[len(passes[mode]) // 2]
            tokens = sum(len(t) for t in kept["tokens"])
            speeds[mode] = tokens / kept["seconds"]
            same = sum(a == b for a, b in zip(kept["tokens"], base, strict=True))
            rows.append(
                {
                    "mode": mode,
                    "batch": batch,
                    "tokens": tokens,
                    "tokens_per_s": speeds[mode],
                    "ratio": speeds[mode] / speeds[first],
                    "al": kept["al"],
                    "al_max": al_bound(kept["tokens"], args.max_draft_len),
                    "same": f"{same}/{len(base)}",
                }
            )
    print(
        f"{'mode':11} {'batch':>5} {'tokens':>7} {'tok/s':>9} {'ratio':>6} {'AL':>5} "
        f"{'AL max':>6} {'same':>6}"
    )
    for r in rows:
        print(
            f"{r['mode']:11} {r['batch']:5d} {r['tokens']:7d} {r['tokens_per_s']:9.1f} "
            f"{r['ratio']:6.2f} {r['al']:5.2f} {r['al_max']:6.2f} {r['same']:>6}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
