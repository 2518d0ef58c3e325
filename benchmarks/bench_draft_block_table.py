"""Per-step cost of the draft sub-page block table (MiniMaxM3DraftSubpageView), per path.

At batch 8 / 64 / 256, in one run, the cost of giving the draft layer's kernel its table, host work
plus the copy into the destination (a device tensor with --device cuda, so H2D is included):

- in-kernel addressing (the TRITON backend): no draft table at all; the kernel reads the target's
  slot rows, which every step copies for the target layers anyway (their cost is shown);
- device expansion: ``copy_batch_block_offsets``, the slot rows sent to the device and expanded
  there in one broadcast into the metadata's persistent buffer;
- host expansion: the same broadcast on the host, then the pages copied;
- per row: a naive version, one small expansion per request.

Prints a table with the ratios; absolute times mean something only on the GPU machine.

    python benchmarks/bench_draft_block_table.py [--device cuda] [--max-seq-len 65536]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.pyexecutor.config import (
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
)


def naive_copy(manager, view, dst: torch.Tensor, request_ids: list[int]) -> None:
    """The per-row version: expand each request's slot list (the manager's) on its own."""
    lanes = torch.arange(view.subdiv)
    for row, rid in enumerate(request_ids):
        slots = torch.tensor(manager.get_cache(rid).block_table, dtype=torch.long)
        k = (slots[:, None] * view.slot_units + lanes).reshape(-1)
        dst[0, row, 0, : k.numel()] = k
        dst[0, row, 1, : k.numel()] = k + view.subdiv
        dst[0, row, 0, k.numel() :] = lanes.repeat(
            view.max_blocks_per_seq // view.subdiv - slots.numel()
        )
        dst[0, row, 1, k.numel() :] = (lanes + view.subdiv).repeat(
            view.max_blocks_per_seq // view.subdiv - slots.numel()
        )


def host_expand_copy(view, dst: torch.Tensor, request_ids: list[int]) -> None:
    """The broadcast on the host, then the page rows copied to ``dst``."""
    slots = view._host_table.batch_slot_rows(request_ids).long()
    lanes = view._lane_offsets.cpu()
    pages = slots[:, None, :, None] * view.slot_units + lanes[None, :, None, :]
    n = slots.shape[0]
    dst[0, :n, :, : view.max_blocks_per_seq].copy_(pages.reshape(n, 2, view.max_blocks_per_seq))


def build(batch: int, max_seq_len: int, device: str):
    # three target layers (1 KV head; index-K on layers 1 and 2), then a 2-KV-head draft layer
    layers = (
        KvCacheLayer(1, 8),
        KvCacheLayer(1, 8, index_head_dim=8),
        KvCacheLayer(1, 8, index_head_dim=8),
        KvCacheLayer(2, 8, is_draft=True),
    )
    options = KvCacheOptions(128, "float16", max_tokens=batch * max_seq_len // 4 + 128 * batch)
    manager = MiniMaxM3KVCacheManagerV2(
        KVCacheManagerV2Config(layers, max_seq_len, batch, options, max_draft_len=3, device=device)
    )
    rng = random.Random(batch)
    for rid in range(batch):  # lengths up to a quarter of max_seq_len
        manager.add_sequence(rid, [1, 2])
        assert manager.resize_sequence(rid, rng.randint(1, max_seq_len // 4))
    return manager


def time_us(fn, device: str, repeats: int = 7, inner: int = 20) -> float:
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-seq-len", type=int, default=65536)
    args = parser.parse_args()
    machine = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{platform.processor() or platform.machine()} CPU"
    )
    print(
        f"draft block-table expansion, max_seq_len={args.max_seq_len}, device={args.device} ({machine})"
    )
    print(
        f"{'batch':>6} {'in-kernel us':>12} {'(target rows us)':>16} {'device exp. us':>14} "
        f"{'host exp. us':>12} {'per-row us':>10} {'per-row / device':>16}"
    )
    for batch in (8, 64, 256):
        times = measure(build(batch, args.max_seq_len, args.device), batch, args.device)
        print(
            f"{batch:>6} {0.0:>12.1f} {times['target']:>16.1f} {times['device']:>14.1f} "
            f"{times['host']:>12.1f} {times['naive']:>10.1f} {times['naive'] / times['device']:>16.2f}"
        )


def measure(manager, batch: int, device: str) -> dict[str, float]:
    """Per-call microseconds of each path, checked to give the same table first."""
    view = manager.draft_subpage_view
    ids = list(range(batch))
    shape = (1, batch, 2, view.max_blocks_per_seq)
    device_dst, host_dst, naive_dst = (
        torch.zeros(shape, dtype=torch.int32, device=device) for _ in range(3)
    )
    target_shape = (manager.num_pools, batch, 2, manager.max_blocks_per_seq)
    target_dst = torch.zeros(target_shape, dtype=torch.int32, device=device)
    view.copy_batch_block_offsets(device_dst, ids)
    host_expand_copy(view, host_dst, ids)
    naive_copy(manager, view, naive_dst, ids)
    assert torch.equal(device_dst, naive_dst) and torch.equal(host_dst, naive_dst)
    return {
        "target": time_us(lambda: manager.copy_batch_block_offsets(target_dst, ids), device),
        "device": time_us(lambda: view.copy_batch_block_offsets(device_dst, ids), device),
        "host": time_us(lambda: host_expand_copy(view, host_dst, ids), device),
        "naive": time_us(lambda: naive_copy(manager, view, naive_dst, ids), device),
    }


if __name__ == "__main__":
    main()
