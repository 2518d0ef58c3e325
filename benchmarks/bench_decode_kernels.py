"""The Triton kernels of one decode step, each timed alone, at bf16 and at FP8 KV: which one lags.

A decode step of the published-width benchmark model (``bench_common.py``: 64 query heads over 4
KV heads of 128; layers 0-2 full attention, 3-7 sparse MiniMax-M3 attention whose indexer keeps one
index-K head of 128 per token and selects the top 16 key blocks of 128 per KV group), one query
token per sequence, at (batch, context) = 1 x 128K, 1 x 512K, 8 x 64K by default. Per layer it
runs the calls below, each timed as the step makes it (its output's allocation included):

- full-attention layer: ``kv write`` (the step's K and V: ``kv_write_kernel.py``, quantized to FP8
  rows and scales in an FP8 cache), ``paged attention`` (``ops.paged_attention``: split-K over
  ``decode_num_splits`` splits, the split reduction included) and, alone, its ``split reduce``;
- sparse layer: ``kv write``, ``index-K write`` (``triton_msa.write_index_k_pages``: the KV write
  kernel, index-K as a K lane), ``block scores`` (the indexer over every cached index-K,
  ``msa_block_scores``), ``block selection`` (``msa_select_blocks``), ``sparse attention``
  (``msa_sparse_attention`` over the selected blocks, split as ``triton_msa_attend`` splits it,
  its reduction included) and, alone, its ``split reduce``.

The KV lives in a real ``MiniMaxM3KVCacheManagerV2`` of two layers, the model's layer 0 and its
first sparse layer (``kv_cache_layers()`` of the benchmark config), ``KvCacheOptions(dtype=...)``
``bfloat16`` or ``fp8`` (float8_e4m3fn rows, a float32 scale per token and head).
The same seeded random K, V and index-K of every cached token go into both through the step's
write paths, so the FP8 cache holds the bf16 K/V quantized, with valid scales; the fp8 and bf16
outputs of both attentions are compared (relative RMS of the difference: they agree loosely).
Launches are sized as the engine's CUDA-graph runner sizes them (``kv_len_bound``: the table).

On CUDA each call is replayed from a CUDA graph (``bench_common.graphed``), the calls timed in
turn in ``--rounds`` rounds of ``time_us`` (``--iters`` replays, median of 5) after a warm-up; the
median round counts. L2 is cold, as in the step (other layers' weights pass through it between
two calls of a kernel): each graph reads a 256 MiB buffer before the call, and the time of a graph
of that read alone, measured in the same round, is subtracted (``--warm-l2``: calls back to back).
Per call: microseconds, the bytes it must read (K and V rows of every cached token for paged
attention, of the selected blocks' tokens for sparse attention; index-K for block scores; block
scores for the selection; partials and log-sum-exps for a reduction; FP8 rows with their float32
scales; a write: bytes read and written), GB/s, their fraction of the copy bandwidth measured in
the same run (a device-to-device ``copy_``, read + written) and the fp8/bf16 time ratio. Then per
KV dtype the step's sum (3 full + 5 sparse layers) and that of the kernels whose work grows with
the context (paged attention, block scores, block selection), with their reads' fraction.

On a CPU the kernels run in Triton's interpreter, each called once: the times mean nothing (a
smoke run; there the split count is 1, so no reduction runs unless ``--splits`` says so).

    python benchmarks/bench_decode_kernels.py [--shapes 1x131072,1x524288,8x65536] \\
        [--kv-dtypes bfloat16,fp8] [--iters 20] [--rounds 3] [--splits auto|N] [--warm-l2]
    python benchmarks/bench_decode_kernels.py --device cpu --shapes 1x512 --iters 1
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

if not torch.cuda.is_available():  # Triton reads it when the kernels are decorated (on import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_attention import warm_up_gpu  # noqa: E402
from bench_common import (  # noqa: E402
    NUM_FULL_LAYERS,
    bench_target_config,
    copy_bandwidth,
    graphed,
    machine_name,
    time_us,
)
from bench_long_context import KV_FORMATS  # noqa: E402

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (  # noqa: E402
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.triton_msa import (  # noqa: E402
    PagedBatch,
    attention_tile_tokens,
    msa_block_scores,
    msa_num_splits,
    msa_select_blocks,
    msa_sparse_attention,
    write_index_k_pages,
)
from tensorrt_llm._torch.attention_backend.triton.addressing import plain_paged_kv  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton.launch import (  # noqa: E402
    is_interpreted,
    launch_split_reduce,
    split_partials,
)
from tensorrt_llm._torch.attention_backend.triton.ops import (  # noqa: E402
    paged_attention,
    paged_attention_num_splits,
    write_kv_pages,
)
from tensorrt_llm._torch.attention_backend.triton.step import StepBatch  # noqa: E402
from tensorrt_llm._torch.pyexecutor.config import (  # noqa: E402
    KVCacheManagerV2Config,
    KvCacheOptions,
)

TPB = 128  # tokens per block (slot), as the engine's default
FULL, SPARSE = 0, 1  # the two-layer cache's layers: the model's layer 0 and its first sparse layer
FLUSH_BYTES = 256 * 2**20  # read before each call for a cold L2 (H100 / H200 L2: 50 / 60 MB)
CHECKED = ("paged attention", "sparse attention")  # outputs compared between fp8 and bf16


@dataclass(frozen=True)
class Kernel:
    layer: str  # "full" or "sparse": the layers of the step that run it
    name: str
    call: Callable[[], object] | None  # None: not launched at this shape (an unsplit op's reduce)
    num_bytes: int  # what the call must read (a write: read and written)
    splits: int = 0  # KV splits of a split op (0: not one)
    grows: bool = False  # its work grows with the context
    us: float = math.nan  # measured


@dataclass(frozen=True)
class StepInputs:
    """The step's new tensors, one token per sequence (seeded: the same for every KV dtype)."""

    q: torch.Tensor  # [batch, num_heads, head_dim]
    k: torch.Tensor  # [batch, num_kv_heads, head_dim]
    v: torch.Tensor  # [batch, num_kv_heads, head_dim]
    index_q: torch.Tensor  # [batch, num_kv_heads, index_head_dim]: one index head per KV group
    index_k: torch.Tensor  # [batch, 1, index_head_dim]


def random_bf16(seed: int, device: str) -> Callable[..., torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)


def filled_manager(config, kv_dtype: str, batch: int, context: int, device: str):
    """Two layers of the model's cache (full, sparse), ``batch`` sequences of ``context`` tokens
    whose K, V and index-K are seeded random values written through the step's write paths."""
    layers = config.kv_cache_layers()
    options = KvCacheOptions(TPB, kv_dtype, batch * (context + TPB), enable_block_reuse=False)
    manager = MiniMaxM3KVCacheManagerV2(
        KVCacheManagerV2Config(
            (layers[0], layers[config.sparse_layer_ids[0]]), context, batch, options, device=device
        )
    )
    ids = list(range(batch))
    for rid in ids:
        manager.add_sequence(rid, [1, 2])
        assert manager.resize_sequence(rid, context)
    # every cached token as one prefill step: its positions and the table rows to write through
    prefill = AttentionMetadata(manager, ids, [context] * batch, [0] * batch, batch, device)
    rand = random_bf16(0, device)
    kv_shape = (batch * context, config.num_key_value_heads, config.head_dim)
    for layer in (FULL, SPARSE):
        kv = plain_paged_kv(manager, layer, prefill.kv_cache_block_offsets)
        pos, seq = prefill.position_ids, prefill.token_seq_idx
        write_kv_pages(rand(*kv_shape), rand(*kv_shape), kv, pos, seq)
    write_index_k_pages(SPARSE, rand(batch * context, 1, config.index_head_dim), prefill)
    return manager


def step_inputs(config, batch: int, device: str) -> StepInputs:
    rand = random_bf16(1, device)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return StepInputs(
        rand(batch, heads, dim),
        rand(batch, kv_heads, dim),
        rand(batch, kv_heads, dim),
        rand(batch, kv_heads, config.index_head_dim),
        rand(batch, 1, config.index_head_dim),
    )


def row_bytes(width: int, kv_dtype: str) -> int:
    """Bytes of a cached (token, head) row of ``width`` elements (FP8: with its float32 scale)."""
    return KV_FORMATS[kv_dtype].row_bytes(width)


def reduce_kernel(layer: str, q: torch.Tensor, num_splits: int) -> Kernel:
    """The split reduction alone, over random partials of the op's shape (not run unsplit)."""
    if num_splits == 1:
        return Kernel(layer, "split reduce", None, 0, num_splits)
    parts, lse = split_partials(q, num_splits)  # [S, batch, H, D], [S, batch, H] fp32
    parts.normal_()
    lse.normal_()
    call = partial(launch_split_reduce, parts, lse, torch.empty_like(q))
    return Kernel(layer, "split reduce", call, 4 * (parts.numel() + lse.numel()), num_splits)


def write_kernel(layer: str, manager, md: AttentionMetadata, x: StepInputs) -> Kernel:
    kv = plain_paged_kv(manager, FULL if layer == "full" else SPARSE, md.kv_cache_block_offsets)
    call = partial(write_kv_pages, x.k, x.v, kv, md.position_ids, md.token_seq_idx)
    written = 2 * x.k.shape[0] * x.k.shape[1] * row_bytes(x.k.shape[2], manager.dtype)
    return Kernel(layer, "kv write", call, 2 * x.k.numel() * x.k.element_size() + written)


def full_layer_kernels(manager, md: AttentionMetadata, x: StepInputs, splits: int | None):
    """A full-attention layer's kernels; ``splits`` None: the op's own choice."""
    kv = plain_paged_kv(manager, FULL, md.kv_cache_block_offsets)
    step = StepBatch.from_metadata(md)
    batch, _, head_dim = x.q.shape
    if splits is None:
        splits = paged_attention_num_splits(x.q, kv, step)
    context = md.num_cached_tokens_per_seq[0] + 1
    read = 2 * batch * context * kv.num_kv_heads * row_bytes(head_dim, manager.dtype)
    attend = partial(paged_attention, x.q, kv, step, head_dim**-0.5, splits)
    return [
        write_kernel("full", manager, md, x),
        Kernel("full", "paged attention", attend, read, splits, grows=True),
        reduce_kernel("full", x.q, splits),
    ]


def sparse_layer_kernels(manager, md: AttentionMetadata, x: StepInputs, cfg, splits):
    """A sparse layer's kernels; ``splits`` None: ``triton_msa_attend``'s choice. The selection
    and the attention run over seeded random block scores, the same at every KV dtype (the
    cache's own scores, near-equal for random index keys, pick other blocks at FP8 than at bf16,
    and the fp8 / bf16 output check would compare attentions over different keys)."""
    pb = PagedBatch.from_metadata(md, manager.layer_pool_index(SPARSE))
    ik_pages, ik_scales = manager.get_index_k_pages(SPARSE), manager.get_index_k_scales(SPARSE)
    k_pages, v_pages = manager.get_kv_pages(SPARSE)
    batch, num_heads, head_dim = x.q.shape
    num_kv_heads = k_pages.shape[2]
    tile = attention_tile_tokens(pb.max_q_len, num_heads // num_kv_heads)
    visited = cfg.topk_blocks * cfg.block_size
    if splits is None:
        splits = msa_num_splits(pb, cfg, num_kv_heads, tile, x.q.device)
    score = partial(msa_block_scores, x.index_q, ik_pages, pb, cfg.block_size, ik_scales)
    shape = score().shape  # [batch, Hkv, num_key_blocks]
    scores = torch.randn(shape, generator=torch.Generator(device=x.q.device).manual_seed(2),
                         device=x.q.device)  # fmt: skip
    select = partial(msa_select_blocks, scores, pb, cfg, tile)
    attend = partial(
        msa_sparse_attention, x.q, k_pages, v_pages, select(), pb, cfg.block_size,
        head_dim**-0.5, splits, manager.get_kv_scales(SPARSE),
    )  # fmt: skip
    context, dtype = md.num_cached_tokens_per_seq[0] + 1, manager.dtype
    index_k = x.index_k.numel() * 2 + batch * row_bytes(x.index_k.shape[2], dtype)
    index_keys = batch * context * row_bytes(x.index_q.shape[2], dtype)
    selected = 2 * batch * num_kv_heads * min(context, visited) * row_bytes(head_dim, dtype)
    return [
        write_kernel("sparse", manager, md, x),
        Kernel(
            "sparse", "index-K write", partial(write_index_k_pages, SPARSE, x.index_k, md), index_k
        ),
        Kernel("sparse", "block scores", score, index_keys, grows=True),
        Kernel("sparse", "block selection", select, scores.numel() * 4, grows=True),
        Kernel("sparse", "sparse attention", attend, selected, splits),
        reduce_kernel("sparse", x.q, splits),
    ]


def l2_flush(device: str) -> Callable[[], object]:
    """A read of ``FLUSH_BYTES`` (a sum into a preallocated scalar): L2 then holds none of the
    next call's inputs, and no dirty line of the flush itself."""
    buffer = torch.ones(FLUSH_BYTES // 4, device=device)
    total = torch.empty((), device=device)
    return lambda: torch.sum(buffer, dim=0, out=total)


def measure(kernels: list[Kernel], device: str, iters: int, rounds: int, warm_l2: bool):
    """Each kernel with its time (``us``): see the module docstring. On a CPU, one call each."""
    launched = [k for k in kernels if k.call is not None]
    if device != "cuda":
        times = []
        for k in launched:
            start = time.perf_counter()
            k.call()
            times.append((time.perf_counter() - start) * 1e6)
    else:
        flush = (lambda: None) if warm_l2 else l2_flush(device)
        calls = [graphed(lambda k=k: (flush(), k.call())) for k in launched]
        floor = None if warm_l2 else graphed(flush)
        warm_up_gpu(1.0)
        samples: list[list[float]] = [[] for _ in launched]
        for _ in range(rounds):
            base = time_us(floor, iters) if floor is not None else 0.0
            for s, call in zip(samples, calls):
                s.append(time_us(call, iters) - base)
        times = [statistics.median(s) for s in samples]
    us = dict(zip((id(k) for k in launched), times))
    return [replace(k, call=None, us=us.get(id(k), math.nan)) for k in kernels]


def measure_dtype(config, kv_dtype: str, batch: int, context: int, args):
    """(the kernels of both layer kinds, measured; the attention outputs, for the check)."""
    manager = filled_manager(config, kv_dtype, batch, context, args.device)
    ids = list(range(batch))
    bound = manager.max_blocks_per_seq * TPB  # the graph runner's kv_len_bound
    md = AttentionMetadata(
        manager, ids, [1] * batch, [context - 1] * batch, 0, args.device, kv_len_bound=bound
    )
    x = step_inputs(config, batch, args.device)
    kernels = full_layer_kernels(manager, md, x, args.splits)
    kernels += sparse_layer_kernels(manager, md, x, config.msa, args.splits)
    outputs = {k.name: k.call().float().cpu() for k in kernels if k.name in CHECKED}
    measured = measure(kernels, args.device, args.iters, args.rounds, args.warm_l2)
    del manager, md, kernels
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return measured, outputs


def print_rows(runs: dict, bandwidth: float) -> None:
    """One row per kernel and KV dtype (``runs``: KV dtype -> (kernels, outputs))."""
    print(
        f"{'layer':<7} {'kernel':<22} {'splits':>6} {'kv dtype':<9} {'us':>9} {'MB':>9} "
        f"{'GB/s':>8} {'/ copy':>7} {'fp8/bf16':>8}"
    )
    for i, first in enumerate(next(iter(runs.values()))[0]):
        for kv_dtype, (kernels, _) in runs.items():
            k = kernels[i]
            cells = f"{'-':>9} {'-':>9} {'-':>8} {'-':>7}"  # not launched
            if not math.isnan(k.us):
                gbs = k.num_bytes / k.us / 1e3
                cells = f"{k.us:>9.2f} {k.num_bytes / 1e6:>9.3f} {gbs:>8.1f} "
                cells += f"{gbs * 1e9 / bandwidth:>7.3f}"
                if kv_dtype == "fp8" and "bfloat16" in runs:
                    cells += f" {k.us / runs['bfloat16'][0][i].us:>8.2f}"
            print(f"{first.layer:<7} {first.name:<22} {k.splits or '-':>6} {kv_dtype:<9} {cells}")


def print_sums(runs: dict, bandwidth: float) -> None:
    """The step's sums per KV dtype, their fp8/bf16 ratios, and the fp8/bf16 output check."""
    num_layers = {"full": NUM_FULL_LAYERS, "sparse": len(bench_target_config().sparse_layer_ids)}
    layers = f"{num_layers['full']} full + {num_layers['sparse']} sparse layers"
    sums = {}
    for kv_dtype, (kernels, _) in runs.items():
        done = [k for k in kernels if not math.isnan(k.us)]
        step = sum(k.us * num_layers[k.layer] for k in done)
        grow_us = sum(k.us * num_layers[k.layer] for k in done if k.grows)
        grow_bytes = sum(k.num_bytes * num_layers[k.layer] for k in done if k.grows)
        sums[kv_dtype] = step, grow_us
        print(
            f"step ({layers}), {kv_dtype}: {step:.1f} us; the kernels growing with the context "
            f"{grow_us:.1f} us, their reads at {grow_bytes / (grow_us * 1e-6) / bandwidth:.3f} of "
            "the copy bandwidth"
        )
    if {"fp8", "bfloat16"} <= sums.keys():
        (s8, g8), (s16, g16) = sums["fp8"], sums["bfloat16"]
        print(f"fp8 / bfloat16: step {s8 / s16:.2f}, the growing kernels {g8 / g16:.2f}")
        for name in CHECKED:
            ref, out = runs["bfloat16"][1][name], runs["fp8"][1][name]
            rel = ((out - ref).norm() / ref.norm()).item()
            verdict = "within" if rel < 0.1 else "BEYOND"
            print(f"fp8 against bf16 {name} output: relative RMS {rel:.4f}, {verdict} 0.1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="1x131072,1x524288,8x65536")
    parser.add_argument("--kv-dtypes", default="bfloat16,fp8")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--splits", default="auto", help="KV splits of both attentions, or auto")
    parser.add_argument("--warm-l2", action="store_true", help="no L2 flush before each call")
    args = parser.parse_args(argv)
    args.splits = None if args.splits == "auto" else int(args.splits)
    args.kv_dtypes = args.kv_dtypes.split(",")
    if args.device == "cpu" and not is_interpreted():
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 set before the run")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = c = bench_target_config()
    bandwidth = copy_bandwidth(args.device, 2**30 if args.device == "cuda" else 2**24)
    print(
        f"decode-step kernels, benchmark model ({c.num_attention_heads} q / {c.num_key_value_heads}"
        f" kv heads of {c.head_dim}, index-K 1 x {c.index_head_dim}, top-{c.index_topk_blocks} "
        f"blocks of {c.index_block_size}), one query token per sequence"
    )
    print(f"machine: {machine_name(args.device)}; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    if args.device == "cuda":
        l2 = "warm L2 (back to back)" if args.warm_l2 else "cold L2 (flush read subtracted)"
        print(f"CUDA-graph replays, median of {args.rounds} rounds of {args.iters}; {l2}")
        warm_up_gpu()
    else:
        print("interpreter times (TRITON_INTERPRET=1), one call each: they mean nothing")
    for shape in args.shapes.split(","):
        batch, context = (int(n) for n in shape.split("x"))
        runs = {d: measure_dtype(config, d, batch, context, args) for d in args.kv_dtypes}
        print(f"\nbatch {batch} x context {context}")
        print_rows(runs, bandwidth)
        print_sums(runs, bandwidth)


if __name__ == "__main__":
    main()
