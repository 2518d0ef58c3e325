"""Slots between parallel layouts: which heads of a slot each rank holds, and the copy that
rebuilds one rank's slots from other ranks' slots.

Under tensor parallelism over ``tp`` ranks that split the KV heads evenly, rank ``r`` holds global
K/V heads ``[r * h, (r + 1) * h)`` of every layer (``h = num_kv_heads / tp``; the drafter's layer
too), and every rank holds the whole index-K (the MSA indexer is replicated). Layouts with fewer
KV heads than ranks (a head replicated over several ranks) are not handled here yet. A block is
``[tokens, heads, head_dim]`` (layout rule 2), so one rank's heads are strided inside a slot of
another layout: a transfer between layouts pulls each source rank's slots whole into a staging
area, then ``regroup_heads`` writes each destination buffer from the source ranks that hold its
heads (index-K from source rank 0). Between equal layouts it is a copy of rank ``r`` to rank
``r``.

This is the layout half of moving KV between a context server and a generation server of
different parallel layouts; the transfer itself (``transceiver.py``) moves whole slots between
single-rank servers today.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm.runtime.kv_cache_manager_v2.config import DataRole
from tensorrt_llm.runtime.kv_cache_manager_v2.layout import BufferPlacement, SlotLayout
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import buffer_view


@dataclass(frozen=True)
class RankSlots:
    """Some slots of one pool of one rank: ``slots [n, layout.slot_bytes]`` (uint8), the rank's
    slot ``layout``, and the rank's place among ``tp_size`` ranks that split the heads."""

    slots: torch.Tensor
    layout: SlotLayout
    rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.slots.dtype != torch.uint8 or self.slots.shape[-1] != self.layout.slot_bytes:
            raise ValueError(
                f"slots must be [n, {self.layout.slot_bytes}] uint8, got "
                f"{list(self.slots.shape)} {self.slots.dtype}"
            )
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank={self.rank} is not in [0, tp_size={self.tp_size})")

    def buffer(self, layer_id: int, role: DataRole) -> BufferPlacement:
        for buf in self.layout.buffers:
            if buf.layer_id == layer_id and buf.role is role:
                return buf
        raise ValueError(
            f"rank {self.rank}'s slots have no {role.value} buffer of layer {layer_id}"
        )

    def heads(self, buf: BufferPlacement) -> range:
        """The global heads ``buf`` holds on this rank (index-K: its one head, on every rank)."""
        if buf.role is DataRole.INDEX_KEY:
            return range(buf.num_heads)
        return range(self.rank * buf.num_heads, (self.rank + 1) * buf.num_heads)


def regroup_heads(sources: list[RankSlots], dest: RankSlots) -> None:
    """Fill every buffer of ``dest`` from ``sources`` (the same slots, in the same order, on every
    source rank of one layout): each destination head from the source rank that holds it."""
    by_rank = {s.rank: s for s in sources}
    tp = {s.tp_size for s in sources}
    if len(tp) != 1 or sorted(by_rank) != list(range(tp.pop())):
        raise ValueError(
            f"sources must be every rank of one layout, got ranks {sorted(by_rank)} of "
            f"tp_size {sorted({s.tp_size for s in sources})}"
        )
    n = dest.slots.shape[0]
    if any(s.slots.shape[0] != n for s in sources):
        raise ValueError(f"every source must hold the destination's {n} slots")
    for dbuf in dest.layout.buffers:
        target = buffer_view(dest.slots, dest.layout, dbuf)  # [n, tokens, heads, dim]
        wanted = dest.heads(dbuf)
        for src in sources:
            sbuf = src.buffer(dbuf.layer_id, dbuf.role)
            if (sbuf.head_dim, sbuf.dtype) != (dbuf.head_dim, dbuf.dtype):
                raise ValueError(
                    f"layer {dbuf.layer_id} {dbuf.role.value}: head_dim/dtype "
                    f"{sbuf.head_dim}/{sbuf.dtype} at the source, {dbuf.head_dim}/{dbuf.dtype} here"
                )
            held = src.heads(sbuf)
            if dbuf.role is DataRole.INDEX_KEY and src.rank != 0:
                continue  # replicated: rank 0's copy
            lo, hi = max(wanted.start, held.start), min(wanted.stop, held.stop)
            if lo < hi:
                source = buffer_view(src.slots, src.layout, sbuf)
                target[:, :, lo - wanted.start : hi - wanted.start] = source[
                    :, :, lo - held.start : hi - held.start
                ]
