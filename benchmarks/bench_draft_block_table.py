"""Per-step cost of the draft sub-page block-table expansion (MiniMaxM3DraftSubpageView).

Measures ``copy_batch_block_offsets`` (one broadcast over the batch) against a naive per-row version
(one small tensor expansion per request) in the same run, at batch 8 / 64 / 256, host work plus the
copy into the destination table (a device tensor with --device cuda, so H2D is included). Prints a
table with the ratio; absolute times mean something only on the GPU machine.

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
    print(f"{'batch':>6} {'vectorized us':>14} {'per-row us':>11} {'per-row / vectorized':>21}")
    for batch in (8, 64, 256):
        manager = build(batch, args.max_seq_len, args.device)
        view = manager.draft_subpage_view
        ids = list(range(batch))
        shape = (1, batch, 2, view.max_blocks_per_seq)
        fast = torch.zeros(shape, dtype=torch.int32, device=args.device)
        slow = torch.zeros(shape, dtype=torch.int32, device=args.device)
        view.copy_batch_block_offsets(fast, ids)
        naive_copy(manager, view, slow, ids)
        assert torch.equal(fast, slow), "the two versions disagree"
        t_fast = time_us(
            lambda v=view, d=fast, r=ids: v.copy_batch_block_offsets(d, r), args.device
        )
        t_slow = time_us(
            lambda m=manager, v=view, d=slow, r=ids: naive_copy(m, v, d, r), args.device
        )
        print(f"{batch:>6} {t_fast:>14.1f} {t_slow:>11.1f} {t_slow / t_fast:>21.2f}")


if __name__ == "__main__":
    main()
