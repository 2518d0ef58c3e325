"""Long context: chunked prefill, then decode, per context length and KV dtype; and the memory
arithmetic of the published MiniMax-M3 (``--memory-table``).

For each KV dtype (``--kv-dtypes``, passed unchanged as ``KvCacheConfig(dtype=...)``) and each
context (``--contexts``, ascending) the script builds an ``LLM`` of the published-width benchmark
model (``bench_common.py``: 8 layers, 0-2 full attention, 3-7 sparse; ``load_format="dummy"``:
configs only, random weights made on the device) whose ``max_seq_len`` is the context plus the new
tokens and whose KV pool is ``max_tokens`` of exactly ``--batch`` such sequences (plus the CUDA
graphs' padding sequence), not a fraction of free memory, with prefix reuse off. It warms up on
short prompts of other tokens, then runs ``--batch`` random prompts of the context's length with
chunked prefill (``--max-num-tokens`` a chunk) and decodes ``--new-tokens`` greedily, driving
``llm.executor`` step by step as ``bench_decode.py`` does (``timed_run``):

- prefill: from enqueueing to every prompt's first token; tokens/s = batch x context / that time;
- decode step: the mean wall time of the decode steps, the device synchronized after each step
  (``--overlap off``, the default): the step's host work plus its device work. ``--overlap on``
  (the LLM's default) times call to call, the device synchronized around the loop only: each
  step then costs max(host, device), which hides the device's growth where the host is the
  slower (batch 8 on an H100);
- reads: what a decode step must read that grows with the context (``decode_reads``), from the
  model config and the KV dtype's bytes, per sequence: K and V of every cached token on the
  full-attention layers, the index key (one head of ``index_head_dim``) of every cached token on
  the sparse layers, and the blocks the sparse layers select (``index_topk_blocks`` x
  ``index_block_size`` tokens of K and V per KV head group; fewer below that context), at the
  prompt's length. FP8 rows (K, V and index-K, per token and head) carry one float32 scale each.
  A token's bytes in the cache are printed beside the LLM's slot layout's (which adds alignment);
- bw (growth): (reads - the base row's reads) / (step - the base row's step) / the copy bandwidth,
  the fraction of the GPU's copy bandwidth that the reads added over the base context reach; the
  base is the smallest context of the run (1K by default; added to ``--contexts`` when they all
  exceed 1K). bw (step): reads / step / copy bandwidth, a lower bound (the step also reads the
  weights). The copy bandwidth is measured in the same run: a device-to-device ``copy_``, counted
  as bytes read + written (``bench_common.copy_bandwidth``).

A KV dtype the LLM cannot be built with (or a cell that runs out of memory) prints a skip line and
the run goes on. The summary gives each dtype's decode step growth over its base step and the
FP8 / bf16 growth ratio per context.

``--memory-table`` prints, from the published config (no device needed: the models are built on
the meta device), the KV bytes per token in bf16 and FP8, the weights' bytes and parameter count
per GPU, and how many 128K and 512K sequences fit beside the weights on one and on eight H200s.

    python benchmarks/bench_long_context.py --device cuda [--contexts 1K,32K,128K,256K,512K] \\
        [--kv-dtypes bfloat16,fp8] [--new-tokens 64] [--max-num-tokens 8192] [--json PATH]
    python benchmarks/bench_long_context.py --device cuda --batch 8 --contexts 64K
    python benchmarks/bench_long_context.py --memory-table [--gpu-gb 141] [--usable-fraction 0.9]
    python benchmarks/bench_long_context.py --scale tiny --device cpu --contexts 256,512 --kv-dtypes bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import (
    NUM_FULL_LAYERS,
    bench_target_config,
    copy_bandwidth,
    machine_name,
    write_dummy_checkpoints,
)
from bench_decode import Settings, StepReads, mode_params, padding_blocks, random_prompts, timed_run

from tensorrt_llm import LLM
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.configuration_minimaxm3 import (
    DENSE_MLP,
    FULL,
    MOE_MLP,
    SPARSE,
    MiniMaxM3Config,
)
from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3ForCausalLM
from tensorrt_llm._torch.models.modeling_minimaxm3_vision import MiniMaxM3VisionConfig
from tensorrt_llm._torch.modules.fp8.modules import use_fp8_block
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.llmapi.llm_args import default_attn_backend
from tensorrt_llm.logger import logger

# per scale: contexts, new tokens, max_num_tokens (the prefill chunk), copy MiB on CUDA / the CPU
SCALE_DEFAULTS = {
    "full": ("1K,32K,128K,256K,512K", 64, 8192, 2048, 512),
    "tiny": ("256,512", 8, 128, 2048, 64),
}
BASE_CONTEXT = 1024  # the growth is over this context's step (or the run's smallest, if smaller)
WARMUP_NEW_TOKENS = 8
GB = 1e9


@dataclasses.dataclass(frozen=True)
class KvFormat:
    """How a KV dtype stores one (token, head) row of ``width`` channels: the elements, plus a
    scale per row (FP8: one float32)."""

    element_bytes: int
    scale_bytes: int = 0

    def row_bytes(self, width: int) -> int:
        return width * self.element_bytes + self.scale_bytes


KV_FORMATS = {
    "float32": KvFormat(4),
    "float16": KvFormat(2),
    "bfloat16": KvFormat(2),
    "fp8": KvFormat(1, scale_bytes=4),  # float8_e4m3fn, a float32 scale per token and head
}


def cached_bytes_per_token(config: MiniMaxM3Config, kv: KvFormat, mapping: Mapping | None = None):
    """One token's KV on one rank (``kv_cache_layers``: the rank's share of the KV heads, K and V
    on every layer, one index-K head on each sparse layer), before slot alignment."""
    return sum(
        2 * layer.num_kv_heads * kv.row_bytes(layer.head_dim)
        + (kv.row_bytes(layer.index_head_dim) if layer.index_head_dim else 0)
        for layer in config.kv_cache_layers(mapping)
    )


@dataclasses.dataclass(frozen=True)
class DecodeReads:
    """What one decode step must read that grows with the context (bytes, the whole batch)."""

    full_kv: int  # full-attention layers: K and V of every cached token
    index_keys: int  # sparse layers: the index key of every cached token
    selected_kv: int  # sparse layers: K and V of the selected blocks, per KV head group

    @property
    def total(self) -> int:
        return self.full_kv + self.index_keys + self.selected_kv


def decode_reads(config: MiniMaxM3Config, kv: KvFormat, context: int, batch: int) -> DecodeReads:
    """``DecodeReads`` of ``batch`` sequences of ``context`` cached tokens (one rank, all heads)."""
    num_sparse = len(config.sparse_layer_ids)
    num_full = config.num_hidden_layers - num_sparse
    kv_row = kv.row_bytes(config.head_dim)
    heads = config.num_key_value_heads
    selected = min(context, config.index_topk_blocks * config.index_block_size)
    return DecodeReads(
        full_kv=batch * context * num_full * 2 * heads * kv_row,
        index_keys=batch * context * num_sparse * kv.row_bytes(config.index_head_dim),
        selected_kv=batch * selected * num_sparse * 2 * heads * kv_row,
    )


@dataclasses.dataclass
class Cell:
    """One (context, KV dtype) run; ``skipped`` says why it did not run."""

    context: int
    batch: int
    kv_dtype: str
    read_bytes: int  # DecodeReads.total
    skipped: str | None = None
    setup_s: float = math.nan  # LLM construction and warm-up
    prefill_s: float = math.nan
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    decode_step_ms: float = math.nan
    graph_steps: int = 0  # timed steps replayed from a CUDA graph
    slot_bytes_per_token: float = math.nan  # from the LLM's slot layout (the arithmetic's check)
    step_floor_bytes: float = math.nan  # weights + experts hit + KV (bench_decode's StepReads)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch * self.context / self.prefill_s


def growth(cell: Cell, base: Cell | None, bandwidth: float) -> dict:
    """The cell's step growth over ``base`` and the fractions of the copy bandwidth (docstring)."""
    out = {"growth_ms": math.nan, "growth_bytes": math.nan, "bw_growth": math.nan}
    out["bw_step"] = cell.read_bytes / (cell.decode_step_ms * 1e-3) / bandwidth
    if base is not None and base is not cell and base.skipped is None:
        out["growth_ms"] = cell.decode_step_ms - base.decode_step_ms
        out["growth_bytes"] = cell.read_bytes - base.read_bytes
        if out["growth_ms"] > 0:  # (a step bound by the host may not grow: no fraction)
            out["bw_growth"] = out["growth_bytes"] / (out["growth_ms"] * 1e-3) / bandwidth
    return out


def make_llm(target_dir: Path, kv_dtype: str, batch: int, s: Settings) -> LLM:
    """An LLM sized to ``batch`` sequences of the context (``s.prompt_len``) plus the new tokens."""
    max_seq_len = s.prompt_len + s.new_tokens
    tokens_per_block = KvCacheConfig().tokens_per_block
    num_blocks = batch * math.ceil(max_seq_len / tokens_per_block)
    num_blocks += padding_blocks(batch, max_seq_len, s)
    return LLM(
        str(target_dir),
        kv_cache_config=KvCacheConfig(
            dtype=kv_dtype, max_tokens=num_blocks * tokens_per_block, enable_block_reuse=False
        ),
        max_batch_size=batch,
        max_num_tokens=s.max_num_tokens,
        max_seq_len=max_seq_len,
        enable_chunked_prefill=True,
        dtype=s.dtype,
        device=s.device,
        attn_backend=s.attn_backend,
        disable_overlap_scheduler=not s.overlap,
        load_format="dummy",
        **({} if s.cuda_graphs else {"cuda_graph_config": None}),
    )


def run_cell(target_dir: Path, cell: Cell, s: Settings) -> Cell:
    """Build, warm up, prefill and decode (the module docstring); a skip on a failed build or an
    out-of-memory run."""
    start = time.perf_counter()
    try:
        llm = make_llm(target_dir, cell.kv_dtype, cell.batch, s)
    except Exception as error:  # noqa: BLE001 - any reason the engine refuses: a skip line
        reason = f"the LLM cannot be built with KvCacheConfig(dtype={cell.kv_dtype!r})"
        return dataclasses.replace(cell, skipped=f"{reason}: {describe(error)}")
    try:
        reads = StepReads(llm, max_draft_len=0)  # before the warm-up captures the graphs
        vocab = llm.model_config.vocab_size
        # other tokens (no reuse), a second chunk over a cached first: the kernels compiled
        warmup = random_prompts(cell.batch, min(cell.context, 2 * s.max_num_tokens), vocab, 7)
        params = mode_params("target", s)  # greedy, ignore_eos
        llm.generate(warmup, dataclasses.replace(params, max_tokens=WARMUP_NEW_TOKENS))
        setup_s = time.perf_counter() - start
        prompts = random_prompts(cell.batch, cell.context, vocab, s.seed)
        result = timed_run(llm, prompts, s, reads, params)
    except torch.cuda.OutOfMemoryError as error:
        return dataclasses.replace(cell, skipped=f"out of memory: {describe(error)}")
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if s.device == "cuda":
            torch.cuda.empty_cache()
    return dataclasses.replace(
        cell,
        setup_s=setup_s,
        prefill_s=result["prefill_s"],
        num_prefill_steps=result["num_prefill_steps"],
        num_decode_steps=result["num_decode_steps"],
        decode_step_ms=result["decode_step_ms"],
        graph_steps=result["graph_steps"],
        slot_bytes_per_token=reads.kv_per_token,
        step_floor_bytes=result["step_bytes"],
    )


def describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def tokens_label(num_tokens: int) -> str:
    return f"{num_tokens // 1024}K" if num_tokens % 1024 == 0 else str(num_tokens)


def parse_tokens(text: str) -> int:
    """``512K`` -> 524288, ``256`` -> 256."""
    text = text.strip()
    scale = 1024 if text[-1:] in ("K", "k") else 1
    value = int(text[:-1] if scale > 1 else text)
    if value <= 0:
        raise ValueError(text)
    return value * scale


def base_of(cells: list[Cell], cell: Cell) -> Cell | None:
    """The run's smallest context of the cell's dtype and batch."""
    same = [c for c in cells if (c.kv_dtype, c.batch) == (cell.kv_dtype, cell.batch)]
    return min(same, key=lambda c: c.context) if same else None


def print_report(cells: list[Cell], args: argparse.Namespace, s: Settings, machine: str, bw: float):
    config = bench_target_config(args.scale)
    print(
        f"long context: random published-width M3 ({args.scale}: {config.num_hidden_layers} "
        f"layers, {config.num_hidden_layers - len(config.sparse_layer_ids)} full attention + "
        f"{len(config.sparse_layer_ids)} sparse, load_format=dummy), batch {args.batch}, "
        f"chunked prefill of {s.max_num_tokens} tokens, {s.new_tokens} new tokens, "
        f"attn_backend={s.attn_backend}, cuda graphs {'on' if s.cuda_graphs else 'off'}, "
        f"overlap scheduler {'on' if s.overlap else 'off'}"
    )
    print(f"machine: {machine}; copy bandwidth {bw / GB:.1f} GB/s (read + written)")
    for name in args.kv_dtypes:
        kv = KV_FORMATS[name]
        one = decode_reads(config, kv, 1, 1)
        selected = decode_reads(config, kv, 1 << 30, 1).selected_kv
        layout = [c.slot_bytes_per_token for c in cells if c.kv_dtype == name and not c.skipped]
        print(
            f"{name}: a cached token {cached_bytes_per_token(config, kv)} B (the LLM's slot "
            f"layout: {f'{layout[0]:.0f} B' if layout else '-'}); a decode step reads, a "
            f"sequence, {one.full_kv} B a cached token (full layers' K and V) + {one.index_keys} B "
            f"(sparse layers' index keys) + {selected / 2**20:.2f} MiB (K and V of the "
            f"{config.index_topk_blocks * config.index_block_size} tokens each sparse layer selects)"
        )
    print(
        f"{'context':>7} {'batch':>5} {'kv':>8} {'setup s':>7} {'prefill s':>9} "
        f"{'prefill tok/s':>13} {'steps':>5} {'step ms':>8} {'growth ms':>9} {'reads MB':>9} "
        f"{'growth MB':>9} {'bw (growth)':>11} {'bw (step)':>9}"
    )
    for c in cells:
        head = f"{tokens_label(c.context):>7} {c.batch:>5} {c.kv_dtype:>8}"
        if c.skipped is not None:
            print(f"{head} skipped: {c.skipped}")
            continue
        g = growth(c, base_of(cells, c), bw)
        print(
            f"{head} {c.setup_s:>7.1f} {c.prefill_s:>9.2f} {c.prefill_tokens_per_s:>13.0f} "
            f"{c.num_decode_steps:>5} {c.decode_step_ms:>8.3f} {g['growth_ms']:>9.3f} "
            f"{c.read_bytes / 1e6:>9.1f} {g['growth_bytes'] / 1e6:>9.1f} {g['bw_growth']:>11.2f} "
            f"{g['bw_step']:>9.2f}"
        )
    for line in summary(cells, bw):
        print(line)


def summary(cells: list[Cell], bandwidth: float) -> list[str]:
    """Each dtype's step growth over its base step; FP8 / bf16 growth per context."""
    ran = [c for c in cells if c.skipped is None]
    lines = []
    for name, batch in dict.fromkeys((c.kv_dtype, c.batch) for c in ran):
        base = base_of(ran, next(c for c in ran if (c.kv_dtype, c.batch) == (name, batch)))
        grown = [c for c in ran if (c.kv_dtype, c.batch) == (name, batch) and c is not base]
        steps = ", ".join(
            f"{tokens_label(c.context)} {growth(c, base, bandwidth)['growth_ms']:+.3f} ms"
            for c in grown
        )
        label = f"{name} batch {batch}: decode step {base.decode_step_ms:.3f} ms at "
        lines.append(label + f"{tokens_label(base.context)}; growth over it: {steps or '-'}")
    at = {(c.kv_dtype, c.batch, c.context): c for c in ran}
    for (name, batch, context), fp8 in at.items():
        bf16 = at.get(("bfloat16", batch, context))
        if name != "fp8" or bf16 is None:
            continue
        g8 = growth(fp8, base_of(ran, fp8), bandwidth)
        g16 = growth(bf16, base_of(ran, bf16), bandwidth)
        if math.isnan(g8["growth_ms"]) or math.isnan(g16["growth_ms"]):
            continue
        lines.append(
            f"batch {batch} at {tokens_label(context)}: fp8 / bfloat16 decode step growth = "
            f"{g8['growth_ms'] / g16['growth_ms']:.2f} (their reads' growth: "
            f"{g8['growth_bytes'] / g16['growth_bytes']:.2f})"
        )
    return lines


# --- the published model's memory arithmetic (--memory-table) -----------------------------------


def published_config() -> MiniMaxM3Config:
    """The published MiniMax-M3 with its vision tower: transformers' defaults for the widths (60
    layers, 4 KV heads of 128, index keys of 128, 128 experts), and the hub config's layers (its
    ``sparse_attention_freq`` / ``moe_layer_freq``): 0-2 full attention with dense MLPs, 3-59
    sparse with the MoE. (Without those keys the defaults make every layer full attention.)"""
    n = MiniMaxM3Config().num_hidden_layers
    return MiniMaxM3Config(
        layer_types=tuple(FULL if i < NUM_FULL_LAYERS else SPARSE for i in range(n)),
        mlp_layer_types=tuple(DENSE_MLP if i < NUM_FULL_LAYERS else MOE_MLP for i in range(n)),
        vision=MiniMaxM3VisionConfig(),
    )


def rank_weights(config: MiniMaxM3Config, mapping: Mapping, fp8: bool) -> tuple[int, int]:
    """Rank 0's parameters and weight bytes under ``mapping`` (the model built on the meta device,
    nothing allocated), bf16, or FP8 block scales where the loader puts them (``use_fp8_block``:
    the LM head, embedding and norms stay bf16)."""
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(config, None, mapping).to(torch.bfloat16)
        num_params = sum(p.numel() for p in model.parameters())
        if fp8:
            use_fp8_block(model, config.modules_to_not_convert, store=True)
    tensors = (*model.parameters(), *model.buffers())
    return num_params, sum(t.numel() * t.element_size() for t in tensors)


EIGHT = dict(world_size=8, tp_size=8)
MEMORY_LAYOUTS = {  # name: (GPUs, rank 0's mapping; None: weights and each sequence in eighths)
    "1 GPU": (1, Mapping()),
    "8 GPUs, split evenly": (8, None),  # the bound no layout reaches
    "8 GPUs, TP8": (8, Mapping(**EIGHT)),
    "8 GPUs, attention DP8 + EP8": (8, Mapping(**EIGHT, enable_attention_dp=True, moe_ep_size=8)),
}
MEMORY_CONTEXTS = (128 * 1024, 512 * 1024)


def memory_table(gpu_gb: float, usable_fraction: float) -> list[dict]:
    """Per layout, weight format and KV dtype: the bytes per GPU and the sequences that fit beside
    the weights (all GPUs together)."""
    config = published_config()
    usable = gpu_gb * GB * usable_fraction
    rows = []
    for layout, (num_gpus, mapping) in MEMORY_LAYOUTS.items():
        for weights in ("bfloat16", "fp8"):
            num_params, weight_bytes = rank_weights(config, mapping or Mapping(), weights == "fp8")
            if mapping is None:
                num_params, weight_bytes = num_params / num_gpus, weight_bytes / num_gpus
            free = usable - weight_bytes
            for kv_dtype in ("bfloat16", "fp8"):
                per_token = cached_bytes_per_token(config, KV_FORMATS[kv_dtype], mapping)
                per_token /= num_gpus if mapping is None else 1
                # attention DP: a GPU holds its own sequences whole; else every GPU a share of each
                whole = mapping is not None and mapping.enable_attention_dp
                fits = [max(0, int(free // (per_token * n))) for n in MEMORY_CONTEXTS]
                fits = [n * num_gpus if whole else n for n in fits]
                rows.append(
                    dict(layout=layout, weights=weights, params_per_gpu=num_params,
                         weight_gb_per_gpu=weight_bytes / GB, kv_gb_per_gpu=max(0.0, free) / GB,
                         kv_dtype=kv_dtype, kv_bytes_per_token_per_gpu=per_token,
                         sequences_128k=fits[0], sequences_512k=fits[1])
                )  # fmt: skip
    return rows


def print_memory_table(gpu_gb: float, usable_fraction: float) -> None:
    config = published_config()
    total, _ = rank_weights(config, Mapping(), fp8=False)
    text, _ = rank_weights(dataclasses.replace(config, vision=None), Mapping(), fp8=False)
    usable = gpu_gb * usable_fraction
    print(
        f"published MiniMax-M3: {config.num_hidden_layers} layers ({NUM_FULL_LAYERS} full "
        f"attention, {len(config.sparse_layer_ids)} sparse with one index-K head of "
        f"{config.index_head_dim}), {config.num_key_value_heads} KV heads of {config.head_dim}; "
        f"{total / 1e9:.2f} B parameters (text {text / 1e9:.2f} B, vision tower and projector "
        f"{(total - text) / 1e9:.2f} B; the MTP module not counted)"
    )
    print(f"one GPU: {gpu_gb:g} GB, {usable_fraction:g} of it usable = {usable:.1f} GB")
    for name in ("bfloat16", "fp8"):
        per_token = cached_bytes_per_token(config, KV_FORMATS[name])
        sizes = [per_token * n / GB for n in MEMORY_CONTEXTS]
        alone = [int(usable * GB // (per_token * n)) for n in MEMORY_CONTEXTS]
        print(
            f"KV in {name}: {per_token} B a token ({per_token / 1024:.2f} KiB); a 128K sequence "
            f"{sizes[0]:.2f} GB, a 512K one {sizes[1]:.2f} GB; {usable:.1f} GB of KV alone holds "
            f"{alone[0]} x 128K or {alone[1]} x 512K"
        )
    rows = memory_table(gpu_gb, usable_fraction)
    print(
        f"{'layout':<28} {'weights':>8} {'params/GPU':>10} {'weights/GPU':>11} {'KV/GPU':>8} | "
        f"{'bf16 KV: B/token/GPU':>20} {'128K':>4} {'512K':>4} | "
        f"{'fp8 KV: B/token/GPU':>19} {'128K':>4} {'512K':>4}"
    )
    for bf16, fp8 in zip(rows[::2], rows[1::2], strict=True):
        print(
            f"{bf16['layout']:<28} {bf16['weights']:>8} {bf16['params_per_gpu'] / 1e9:>9.2f}B "
            f"{bf16['weight_gb_per_gpu']:>9.1f}GB {bf16['kv_gb_per_gpu']:>6.1f}GB | "
            f"{bf16['kv_bytes_per_token_per_gpu']:>20.0f} {bf16['sequences_128k']:>4} "
            f"{bf16['sequences_512k']:>4} | {fp8['kv_bytes_per_token_per_gpu']:>19.0f} "
            f"{fp8['sequences_128k']:>4} {fp8['sequences_512k']:>4}"
        )
    print(
        "(sequences that fit beside the weights, all GPUs together. TP8: a GPU holds one of the 4 "
        "KV heads, each head on two GPUs, and every index key; attention DP: a GPU holds its own "
        "sequences whole; KV/GPU 0.0: the weights alone exceed the GPU)"
    )


# --- the command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--scale", default="full", choices=sorted(SCALE_DEFAULTS))
    parser.add_argument("--contexts", help="comma-separated tokens, K = 1024 (default 1K..512K)")
    parser.add_argument("--kv-dtypes", default="bfloat16,fp8", help="KvCacheConfig.dtype values")
    parser.add_argument("--batch", type=int, default=1, help="sequences of each context")
    parser.add_argument("--new-tokens", type=int, help="decoded per sequence (default 64; tiny 8)")
    parser.add_argument("--max-num-tokens", type=int, help="the prefill chunk (default 8192)")
    parser.add_argument("--attn-backend", choices=["VANILLA", "TRITON"])
    parser.add_argument("--cuda-graphs", default="on", choices=["on", "off"])
    parser.add_argument(
        "--overlap",
        default="off",
        choices=["on", "off"],
        help="the overlap scheduler (off: each step synchronized; on: the LLM's default)",
    )
    parser.add_argument("--max-seconds", type=float, default=120.0, help="decode cap per cell")
    parser.add_argument("--copy-mib", type=int, help="copy size for the bandwidth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--memory-table", action="store_true", help="the published model's")
    parser.add_argument("--gpu-gb", type=float, default=141.0, help="memory-table: one GPU's GB")
    parser.add_argument("--usable-fraction", type=float, default=0.9)
    args = parser.parse_args(argv)
    contexts, new_tokens, chunk, copy_cuda, copy_cpu = SCALE_DEFAULTS[args.scale]
    try:
        contexts = sorted({parse_tokens(t) for t in (args.contexts or contexts).split(",")})
    except ValueError:
        parser.error(f"--contexts={args.contexts!r}: expected positive token counts, e.g. 1K,32K")
    args.contexts = sorted({min(BASE_CONTEXT, contexts[0]), *contexts})
    args.kv_dtypes = list(dict.fromkeys(args.kv_dtypes.split(",")))
    if unknown := sorted(set(args.kv_dtypes) - set(KV_FORMATS)):
        parser.error(f"--kv-dtypes: no byte arithmetic for {unknown}; known: {sorted(KV_FORMATS)}")
    if args.batch < 1:
        parser.error(f"--batch={args.batch} must be >= 1")
    if args.copy_mib is None:
        args.copy_mib = copy_cuda if args.device == "cuda" else copy_cpu
    backend = args.attn_backend or default_attn_backend(args.device)
    settings = Settings(
        scale=args.scale,
        device=args.device,
        dtype="bfloat16",
        attn_backend=backend,
        cuda_graphs=args.cuda_graphs == "on" and args.device == "cuda" and backend == "TRITON",
        prompt_len=args.contexts[-1],  # per cell: its context
        new_tokens=new_tokens if args.new_tokens is None else args.new_tokens,
        max_draft_len=0,
        max_num_tokens=chunk if args.max_num_tokens is None else args.max_num_tokens,
        max_seconds=args.max_seconds,
        seed=args.seed,
        load_format="dummy",
        overlap=args.overlap == "on",
    )
    return args, settings


def write_json(path: Path, machine: str, s: Settings, bw: float, cells: list[Cell]) -> None:
    record = {
        "machine": machine,
        "settings": dataclasses.asdict(s),
        "copy_bandwidth_bytes_per_s": bw,
        "cells": [
            {**dataclasses.asdict(c), **({} if c.skipped else growth(c, base_of(cells, c), bw))}
            for c in cells
        ],
        "summary": summary(cells, bw),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> list[Cell]:
    args, s = parse_args(argv)
    if args.memory_table:
        print_memory_table(args.gpu_gb, args.usable_fraction)
        return []
    logger.set_level("warning")
    torch.manual_seed(s.seed)
    machine = machine_name(s.device)
    bandwidth = copy_bandwidth(s.device, args.copy_mib * 2**20)
    max_positions = args.contexts[-1] + s.new_tokens
    config = bench_target_config(s.scale, max_positions)
    started = time.perf_counter()
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="bench_long_context_") as tmp:
        target_dir, _ = write_dummy_checkpoints(Path(tmp), s.scale, max_positions=max_positions)
        for kv_dtype in args.kv_dtypes:
            for context in args.contexts:
                reads = decode_reads(config, KV_FORMATS[kv_dtype], context, args.batch)
                cell = Cell(context, args.batch, kv_dtype, reads.total)
                cell = run_cell(target_dir, cell, dataclasses.replace(s, prompt_len=context))
                cells.append(cell)
                done = (
                    f"skipped: {cell.skipped}"
                    if cell.skipped
                    else f"prefill {cell.prefill_s:.2f} s, step {cell.decode_step_ms:.3f} ms"
                )
                print(
                    f"[{time.perf_counter() - started:6.1f} s] {tokens_label(context)} x "
                    f"{args.batch} {kv_dtype}: {done}",
                    file=sys.stderr,
                    flush=True,
                )
                if args.json is not None:
                    write_json(args.json, machine, s, bandwidth, cells)
    print_report(cells, args, s, machine, bandwidth)
    print(f"total {time.perf_counter() - started:.1f} s")
    return cells


if __name__ == "__main__":
    main()
