"""``trtllm-eval``: accuracy and acceptance length (AL) on the bundled tasks.

    trtllm-eval gsm8k-tiny      [--num-samples 200]
    trtllm-eval multiturn-copy  [--num-samples 32]
    trtllm-eval long-prompt     [--num-samples 50]
    trtllm-eval al-table        [--num-samples 200 --num-conversations 32] [--out-dir eval_out]
    trtllm-eval gsm8k-thinking  [--num-samples 200] [--thinking-mode enabled|disabled|adaptive]
    trtllm-eval tool-use        [--num-samples 200] [--thinking-mode ...]

The last two need a checkpoint that speaks MiniMax-M3's chat protocol (its
``chat_template.jinja``; ``evaluate/m3_runner.py``); without ``--thinking-mode`` they run each
mode.

``--model`` / ``--speculative-model`` default to the bundled checkpoint; ``--draft-kv-cache``
picks unified (default), separate or none (target only) for the single tasks; ``--quant fp8``
quantizes the target at load (``QuantConfig(quant_algo="FP8_BLOCK_SCALES")``: FP8 kernels on
CUDA, weights rounded to the FP8 grid on the CPU). ``--kv-cache-dtype fp8`` keeps the KV cache in
FP8 (``KvCacheConfig(dtype="fp8")``); for ``al-table`` a list, ``auto,fp8``: the table at the first,
plus rows at each other dtype (target only, the unified drafters, Eagle3 unified disaggregated).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tensorrt_llm.bundled import BUNDLED_DRAFT, bundled_target
from tensorrt_llm.evaluate.al_table import build_al_table
from tensorrt_llm.evaluate.m3_runner import run_gsm8k_thinking, run_tool_use
from tensorrt_llm.evaluate.runner import (
    run_gsm8k,
    run_long_prompt,
    run_multiturn_copy,
    warn_unless_held_out,
)

DRAFT_KV_CHOICES = ["unified", "separate", "mtp-unified", "mtp-separate", "none"]
DRAFT_KV_HELP = "the drafter and where its KV lives: Eagle3's, or (mtp-) the target's MTP module's"
TASKS = ("gsm8k-tiny", "multiturn-copy", "long-prompt", "al-table", "gsm8k-thinking", "tool-use")


def speculative_options(args, mode: str | None) -> dict | None:
    """The ``speculative_config`` of a draft KV mode: Eagle3's ``unified`` / ``separate``, the
    target's MTP module's ``mtp-unified`` / ``mtp-separate``; None: no speculation."""
    if mode is None:
        return None
    if mode.startswith("mtp-"):
        kv = mode.removeprefix("mtp-")
        return {"decoding_type": "MTP", "max_draft_len": args.max_draft_len, "draft_kv_cache": kv}
    return {
        "decoding_type": "Eagle3",
        "max_draft_len": args.max_draft_len,
        "speculative_model": args.speculative_model,
        "draft_kv_cache": mode,
    }


def has_mtp_module(model_dir: str) -> bool:
    from tensorrt_llm._torch.models.checkpoint import load_config

    return bool(getattr(load_config(model_dir), "num_mtp_modules", 0))


def speaks_m3(model_dir: str) -> bool:
    """Whether the checkpoint's tokenizer has MiniMax-M3's tool-call namespace token (its tools
    and reasoning can be evaluated)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    return path.is_file() and "]<]minimax[>[" in Tokenizer.from_file(str(path)).get_vocab()


def make_llm_factory(args):
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import KvCacheConfig, QuantConfig

    quant = QuantConfig(quant_algo="FP8_BLOCK_SCALES") if args.quant == "fp8" else None

    def make(mode: str | None, kv_dtype: str | None = None):
        return LLM(
            args.model,
            device=args.device,
            max_batch_size=args.max_batch_size,
            kv_cache_config=KvCacheConfig(
                tokens_per_block=args.tokens_per_block,
                max_tokens=args.kv_max_tokens,
                dtype=kv_dtype or args.kv_cache_dtypes[0],
            ),
            speculative_config=speculative_options(args, mode),
            quant_config=quant,
        )

    return make


def deployment_options_factory(args):
    """The LLM options of the context and generation servers for a draft KV mode."""

    def options(mode: str | None, kv_dtype: str | None = None) -> dict:
        return {
            "model": args.model,
            "max_batch_size": args.max_batch_size,
            "kv_cache_config": {
                "tokens_per_block": args.tokens_per_block,
                "max_tokens": args.kv_max_tokens,
                "dtype": kv_dtype or args.kv_cache_dtypes[0],
            },
            "speculative_config": speculative_options(args, mode),
            "quant_config": {"quant_algo": "FP8_BLOCK_SCALES"} if args.quant == "fp8" else None,
        }

    return options


def kv_cache_dtypes(parser: argparse.ArgumentParser, args) -> list[str]:
    """``--kv-cache-dtype`` as a list: one dtype, or (al-table) several, each a KV dtype."""
    from tensorrt_llm.llmapi import KvCacheConfig

    dtypes = [d.strip() for d in args.kv_cache_dtype.split(",")]
    allowed = KvCacheConfig.model_fields["dtype"].annotation.__args__
    bad = [d for d in dtypes if d not in allowed]
    if bad or len(set(dtypes)) != len(dtypes) or (len(dtypes) > 1 and args.task != "al-table"):
        parser.error(
            f"--kv-cache-dtype {args.kv_cache_dtype!r}: one of {list(allowed)} (al-table: several, "
            "comma-separated, each once)"
        )
    return dtypes


def run_al_table(args, make, progress) -> int:
    """``trtllm-eval al-table``: 0 when the target's outputs were identical in every mode."""
    settings = {
        "kv_cache_dtype": args.kv_cache_dtypes[0],
        "tokens_per_block": args.tokens_per_block,
        "max_draft_len": args.max_draft_len,
        "device": args.device,
    }
    summary = build_al_table(
        make,
        args.num_samples or 200,
        args.num_conversations,
        args.out_dir,
        progress,
        settings,
        None if args.no_disaggregated else deployment_options_factory(args),
        mtp=has_mtp_module(args.model),
        tool_use=speaks_m3(args.model),
        kv_dtypes=tuple(args.kv_cache_dtypes[1:]),
    )
    print(f"wrote {args.out_dir}/al_table.md, al_table.json, al_per_turn.png")
    return 0 if summary["outputs_identical_in_every_mode"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trtllm-eval", description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=TASKS)
    parser.add_argument(
        "--model", default=None, help="target checkpoint (default: the bundled one)"
    )
    parser.add_argument(
        "--speculative-model", default=None, help="Eagle3 checkpoint (default: the bundled one)"
    )
    parser.add_argument(
        "--draft-kv-cache", choices=DRAFT_KV_CHOICES, default="unified", help=DRAFT_KV_HELP
    )
    parser.add_argument("--max-draft-len", type=int, default=3)
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--num-conversations", type=int, default=32)
    parser.add_argument("--tokens-per-block", type=int, default=128)
    parser.add_argument("--kv-max-tokens", type=int, default=262144)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quant", choices=["fp8"], help="quantize the target at load")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the KV cache dtype (auto, bfloat16, fp8, ...); al-table: a list, auto,fp8: the "
        "table at the first and rows at the others",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("eval_out"))
    parser.add_argument(
        "--thinking-mode",
        choices=["enabled", "disabled", "adaptive"],
        default=None,
        help="gsm8k-thinking and tool-use: this mode only (default: each)",
    )
    parser.add_argument(
        "--no-disaggregated",
        action="store_true",
        help="al-table: skip the disaggregated deployments",
    )
    args = parser.parse_args(argv)
    args.kv_cache_dtypes = kv_cache_dtypes(parser, args)
    args.model = args.model or bundled_target()
    args.speculative_model = args.speculative_model or str(BUNDLED_DRAFT)
    make = make_llm_factory(args)
    warn_unless_held_out(args.model, args.speculative_model)

    def progress(line: str) -> None:
        print(line, flush=True)

    if args.task == "al-table":
        return run_al_table(args, make, progress)
    llm = make(None if args.draft_kv_cache == "none" else args.draft_kv_cache)
    if args.task in ("gsm8k-thinking", "tool-use"):
        run = run_gsm8k_thinking if args.task == "gsm8k-thinking" else run_tool_use
        modes = [args.thinking_mode] if args.thinking_mode else ["enabled", "disabled", "adaptive"]
        result = {"modes": [run(llm, args.num_samples or 200, m, progress) for m in modes]}
        for entry in result["modes"]:
            entry.pop("texts", None)
    elif args.task == "gsm8k-tiny":
        result = run_gsm8k(llm, args.num_samples or 200, progress)
    elif args.task == "long-prompt":
        result = run_long_prompt(llm, args.num_samples or 50, progress)
    else:
        turns = run_multiturn_copy(llm, args.num_samples or 32, progress)
        result = {"al_per_turn": [t.al for t in turns], "exact_per_turn": [t.exact for t in turns]}
    result.pop("token_ids", None)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{args.task}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
