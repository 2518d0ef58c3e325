"""Decode attention of the Eagle3 draft layer through the unified cache, against contiguous SDPA.

The M3 draft geometry (16 query / 4 KV heads, head_dim 128, bf16), one query token per sequence,
at (batch, context) = (8, 32K), (64, 8K), (256, 4K). Each shape is timed four ways in one run:

- ``view, expanded``: the Triton kernel through the draft sub-page view's expanded 32-token table;
- ``view, in-kernel``: the same kernel reading the target's 128-token slot table and computing the
  sub-page address itself (no expanded table);
- ``128-token pages``: the same kernel over a plain cache of the draft geometry in 128-token pages;
- ``SDPA``: ``torch.nn.functional.scaled_dot_product_attention`` over the same KV stored contiguously.

Effective bandwidth counts the K and V bytes each call must read (batch x context x 4 heads x 128 x
2 bytes x 2); the table gives it and its ratio to SDPA's. Each path is one call replayed from a
CUDA graph, as the engine's decode steps run it (a call's host work is not what is measured:
eagerly, at 8 x 32K it is as long as the kernel and the timings swing), the paths timed in turn
in three rounds
after a warm-up (the median round counts), so a GPU that idled while the caches were built is not
measured cold. The KV lives in a real
``MiniMaxM3KVCacheManagerV2`` of the M3-shaped benchmark model (its draft sub-pages are 32 tokens
of a 128-token slot that also holds 8 target layers). Needs a CUDA device.

    python benchmarks/bench_attention.py [--shapes 8x32768,64x8192,256x4096] [--iters 50]
"""

from __future__ import annotations

import argparse
import gc
import math
import time

import torch
import torch.nn.functional as F
from bench_common import (
    bench_eagle3_config,
    bench_target_config,
    graphed,
    machine_name,
    time_us,
)

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.triton.addressing import (
    draft_subpage_kv,
    plain_paged_kv,
)
from tensorrt_llm._torch.attention_backend.triton.ops import paged_attention
from tensorrt_llm._torch.attention_backend.triton.step import StepBatch
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.config import (
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
    PyExecutorConfig,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig

HEADS, KV_HEADS, HEAD_DIM, TPB = 16, 4, 128, 128


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Busy the GPU until its clocks settle, so the first timed shape is not measured cold."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x @ x
        torch.cuda.synchronize()


def filled(manager: KVCacheManagerV2, batch: int, context: int) -> KVCacheManagerV2:
    """``batch`` sequences of ``context`` tokens with random KV (the pools' bytes)."""
    for rid in range(batch):
        manager.add_sequence(rid, [1, 2])
        assert manager.resize_sequence(rid, context)
    for pool in manager.pools:
        pool.view(torch.bfloat16).normal_()
    return manager


def unified_manager(batch: int, context: int) -> KVCacheManagerV2:
    target = bench_target_config()
    draft = bench_eagle3_config(target)
    runtime = PyExecutorConfig(
        max_batch_size=batch,
        max_num_tokens=8192,
        max_seq_len=context,
        kv_cache=KvCacheOptions(TPB, "bfloat16", max_tokens=batch * (context + TPB)),
        speculative=Eagle3SpecConfig(3, "unused"),
        device="cuda",
    )
    geometry = (draft.num_key_value_heads, draft.head_dim)
    managers = create_kv_cache_managers(target, runtime, geometry)
    return filled(managers[ResourceManagerType.KV_CACHE_MANAGER], batch, context)


def plain_manager(batch: int, context: int) -> KVCacheManagerV2:
    config = KVCacheManagerV2Config(
        layers=(KvCacheLayer(KV_HEADS, HEAD_DIM),),
        max_seq_len=context,
        max_batch_size=batch,
        options=KvCacheOptions(TPB, "bfloat16", max_tokens=batch * (context + TPB)),
        device="cuda",
    )
    return filled(KVCacheManagerV2(config), batch, context)


def decode_metadata(manager, batch: int, context: int) -> AttentionMetadata:
    """One query token per sequence at position ``context - 1``."""
    ids = list(range(batch))
    return AttentionMetadata(manager, ids, [1] * batch, [context - 1] * batch, 0, "cuda")


def paths(batch: int, context: int, q: torch.Tensor) -> dict:
    """The calls to time, by path: the Triton kernel through the view (expanded table, in-kernel
    addressing; checked equal) and through 128-token pages, and SDPA over contiguous KV."""
    scale = 1 / math.sqrt(HEAD_DIM)
    target = unified_manager(batch, context)
    view = target.draft_subpage_view
    layer = view.draft_layer_ids[0]
    view_md = decode_metadata(view, batch, context)
    slot_md = decode_metadata(target, batch, context)
    expanded = plain_paged_kv(view, layer, view_md.kv_cache_block_offsets)
    in_kernel = draft_subpage_kv(view, layer, target, slot_md.kv_cache_block_offsets)
    step = StepBatch.from_metadata(view_md)
    torch.testing.assert_close(
        paged_attention(q, in_kernel, step, scale), paged_attention(q, expanded, step, scale)
    )
    plain = plain_manager(batch, context)
    plain_md = decode_metadata(plain, batch, context)
    pages = plain_paged_kv(plain, 0, plain_md.kv_cache_block_offsets)
    plain_step = StepBatch.from_metadata(plain_md)
    k, v = (
        torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    q4 = q[:, :, None, :]  # [batch, heads, 1, head_dim]
    return {
        "view, expanded": lambda: paged_attention(q, expanded, step, scale),
        "view, in-kernel": lambda: paged_attention(q, in_kernel, step, scale),
        "128-token pages": lambda: paged_attention(q, pages, plain_step, scale),
        "SDPA, contiguous": lambda: F.scaled_dot_product_attention(
            q4, k, v, scale=scale, enable_gqa=True
        ),
    }


def measure(batch: int, context: int, iters: int, rounds: int = 3) -> list[tuple[str, float]]:
    """Each path's median over ``rounds`` rounds that take the paths in turn, after a warm-up
    right before (building the caches leaves the GPU idle, and its clocks drop)."""
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    calls = {name: graphed(call) for name, call in paths(batch, context, q).items()}
    warm_up_gpu(1.0)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(time_us(call, iters))
    return [(name, sorted(t)[len(t) // 2]) for name, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x32768,64x8192,256x4096")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    print(f"draft decode attention, 16 q / 4 kv heads, head_dim 128, bf16; {machine_name('cuda')}")
    warm_up_gpu()
    print(f"{'batch':>5} {'context':>7}  {'path':<17} {'us':>9} {'GB/s':>8} {'/ SDPA':>7}")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
        rows = measure(batch, context, args.iters)
        gc.collect()
        sdpa_gbs = kv_bytes / rows[-1][1] / 1e3
        for path, us in rows:
            gbs = kv_bytes / us / 1e3
            print(
                f"{batch:>5} {context:>7}  {path:<17} {us:>9.1f} {gbs:>8.0f} {gbs / sdpa_gbs:>7.2f}"
            )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
