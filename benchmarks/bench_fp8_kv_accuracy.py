"""FP8 KV accuracy: the scale granularities tried, each against the KV cache in the model's dtype.

Each scheme answers the same held-out gsm8k-tiny problems greedily (``return_generation_logits``)
on the torch reference (``VANILLA``, CPU: the accuracy of a scheme is a property of its
arithmetic, not of a kernel), with ``KvCacheConfig(dtype="fp8")`` and the reference's write-side
quantizer swapped for the scheme's. Against the replies with the KV in the model's dtype:

- ``right``: gsm8k-tiny answers right (the bundled model only: a random model answers nothing);
- ``identical``: replies token for token the same;
- ``|d logprob|``: over every position before a reply first differs, the change of the reference
  token's log-probability (mean and max).

Schemes (each a way to store a ``head_dim`` row of a token and head as float8_e4m3fn):

- ``amax / token-head``: the cache's (``kv_quant.py``): the float32 scale ``amax / 448`` per row
  (the row's largest element stored as 448);
- ``pow2 / token-head``: a power-of-two float32 scale per row, the row's largest element in
  (224, 448] (scaling is exact both ways, but the rounding is that of no scale at all);
- ``1 / tensor``: no scale at all (one per-tensor scale of 1, as an uncalibrated per-tensor
  cache stores it).

A per-block scale is not among them: a block's tokens arrive over many steps, so a scale fixed
at its first token cannot hold the later ones' range without re-quantizing what is written,
which a reused or transferred block must never see change.

Models: the bundled M3-tiny (float32, trained) and ``random-published``: the published M3's layer
arrangement at the benchmark's tiny widths with random weights (``bench_common``, seed 0),
bfloat16.

    python benchmarks/bench_fp8_kv_accuracy.py [--num-samples 40] [--max-tokens 128] [--models bundled,random-published]
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from bench_common import machine_name, write_dummy_checkpoints

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.attention_backend import kv_quant, reference
from tensorrt_llm.bundled import BUNDLED_TARGET
from tensorrt_llm.evaluate.runner import reply_content
from tensorrt_llm.evaluate.tasks import evaluation_problems, parse_answer
from tensorrt_llm.llmapi.llm_args import KvCacheConfig
from tensorrt_llm.logger import logger


def _pow2_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The power of two that puts the row's largest element in (224, 448]."""
    amax = x.float().abs().amax(dim=-1).clamp(min=kv_quant.MIN_SCALE)
    scales = torch.exp2(torch.ceil(torch.log2(amax / kv_quant.FP8_MAX)))
    return (x.float() / scales[..., None]).to(kv_quant.FP8_DTYPE), scales


def _no_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.float().clamp(-kv_quant.FP8_MAX, kv_quant.FP8_MAX).to(kv_quant.FP8_DTYPE)
    return rows, torch.ones(x.shape[:-1], device=x.device)


SCHEMES = {
    "amax / token-head": kv_quant.quantize_rows,
    "pow2 / token-head": _pow2_scale,
    "1 / tensor": _no_scale,
}


@contextmanager
def quantizer(fn):
    saved = reference.quantize_rows
    reference.quantize_rows = fn
    try:
        yield
    finally:
        reference.quantize_rows = saved


def replies(model: str, kv_dtype: str, prompts: list, max_tokens: int, **options) -> list:
    llm = LLM(
        model,
        device="cpu",
        attn_backend="VANILLA",
        kv_cache_config=KvCacheConfig(dtype=kv_dtype, max_tokens=16384),
        **options,
    )
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, return_generation_logits=True)
        return llm.generate(prompts, params)
    finally:
        llm.shutdown()


def compare(reference_outs: list, outs: list, answers: list | None, prompts: list) -> dict:
    deltas, identical, right = [], 0, 0
    for ref, out, prompt, answer in zip(
        reference_outs, outs, prompts, answers or [None] * len(outs)
    ):
        r, o = ref.outputs[0], out.outputs[0]
        same = 0
        while (
            same < min(len(r.token_ids), len(o.token_ids))
            and r.token_ids[same] == o.token_ids[same]
        ):
            same += 1
        identical += r.token_ids == o.token_ids
        ids = torch.tensor(r.token_ids[:same])
        lp_ref = torch.log_softmax(r.generation_logits[:same].float(), -1)[torch.arange(same), ids]
        lp_out = torch.log_softmax(o.generation_logits[:same].float(), -1)[torch.arange(same), ids]
        deltas.append((lp_out - lp_ref).abs())
        if answer is not None:
            right += parse_answer(reply_content(o.text, prompt)) == answer
    d = torch.cat(deltas)
    return {
        "right": right if answers else None,
        "identical": identical,
        "positions": d.numel(),
        "mean": d.mean().item() if d.numel() else 0.0,
        "max": d.max().item() if d.numel() else 0.0,
    }


def model_prompts(name: str, root: Path, count: int) -> tuple[str, list, list | None, dict]:
    """(model folder, prompts, answers or None, LLM options)."""
    problems = evaluation_problems("gsm8k-tiny", count)
    if name == "bundled":
        llm = LLM(str(BUNDLED_TARGET), device="cpu")
        prompts = [llm.tokenizer.apply_chat_template(m[:1]) for m, _ in problems]
        llm.shutdown()
        return str(BUNDLED_TARGET), prompts, [a for _, a in problems], {}
    target, _ = write_dummy_checkpoints(root, "tiny")
    prompts = [m[0]["content"] for m, _ in problems]
    return str(target), prompts, None, {"load_format": "dummy", "dtype": "bfloat16"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--models", default="bundled,random-published")
    args = parser.parse_args()
    logger.set_level("warning")
    print(
        f"FP8 KV accuracy against the model's-dtype KV, {args.num_samples} gsm8k-tiny prompts, "
        f"{args.max_tokens} tokens, greedy, on {machine_name('cpu')}"
    )
    print(
        f"{'model':<17} {'scheme':<18} {'right':>6} {'identical':>10} {'positions':>10} "
        f"{'mean |d logprob|':>17} {'max':>8}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model, prompts, answers, options = model_prompts(
                name, Path(tmp) / name, args.num_samples
            )
            base = replies(model, "auto", prompts, args.max_tokens, **options)
            rows = {"model dtype": compare(base, base, answers, prompts)}
            for scheme, fn in SCHEMES.items():
                with quantizer(fn):
                    outs = replies(model, "fp8", prompts, args.max_tokens, **options)
                rows[scheme] = compare(base, outs, answers, prompts)
            for scheme, r in rows.items():
                right = "-" if r["right"] is None else f"{r['right']}/{len(prompts)}"
                print(
                    f"{name:<17} {scheme:<18} {right:>6} {r['identical']:>4}/{len(prompts):<5} "
                    f"{r['positions']:>10} {r['mean']:>17.4f} {r['max']:>8.4f}"
                )


if __name__ == "__main__":
    main()
