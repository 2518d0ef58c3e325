"""Slots between parallel layouts: which heads of a slot each rank holds, and the copy that
rebuilds one rank's slots from other ranks' slots.

Under tensor parallelism over ``tp`` ranks that split the KV heads evenly, rank ``r`` holds global
K/V heads ``[r * h, (r + 1) * h)`` of every layer (``h = num_kv_heads / tp``; the drafter's layer
too), and every rank holds the whole index-K (the MSA indexer is replicated). An FP8 cache's scale
buffers (one float32 per token and head) split like the rows they scale. An attention-DP rank
holds every head (``tp = 1`` for its slots). Layouts with fewer KV heads than ranks (a head
replicated over several ranks) cross only to a server of the same layout. A block is
``[tokens, heads, head_dim]`` (layout rule 2), so one rank's heads are strided inside a slot of
another layout: a transfer between layouts pulls each source rank's slots whole into a staging
area, then ``regroup_heads`` writes each destination buffer from the source ranks that hold its
heads (index-K and its scales from the first source).

``peer_layouts`` rebuilds a context rank's slot layout from its fingerprint and says whether the
two layouts hold the same heads (then slots cross byte for byte, no staging); servers of
different KV dtypes are refused there, naming both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tensorrt_llm._torch.disaggregation.params import LayoutFingerprint, parallel_ranks
from tensorrt_llm.runtime.kv_cache_manager_v2.config import DataRole
from tensorrt_llm.runtime.kv_cache_manager_v2.layout import BufferPlacement, SlotLayout
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import buffer_view

_REPLICATED = (DataRole.INDEX_KEY, DataRole.INDEX_KEY_SCALE)


def replicated(role: DataRole) -> bool:
    """Whether every rank holds a buffer of ``role`` whole (the MSA indexer is replicated: its
    keys, and an FP8 cache's scales of them); other buffers are split by head like K and V."""
    return role in _REPLICATED


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
        if replicated(buf.role):
            return range(buf.num_heads)
        return range(self.rank * buf.num_heads, (self.rank + 1) * buf.num_heads)


def regroup_heads(sources: list[RankSlots], dest: RankSlots) -> None:
    """Fill every buffer of ``dest`` from ``sources`` (the same slots, in the same order, on
    source ranks of one layout; at least those that hold ``dest``'s heads): each destination head
    from the source rank that holds it, index-K from the first source."""
    if len({s.tp_size for s in sources}) != 1 or len({s.rank for s in sources}) != len(sources):
        raise ValueError(
            f"sources must be distinct ranks of one layout, got ranks {[s.rank for s in sources]} "
            f"of tp_size {sorted({s.tp_size for s in sources})}"
        )
    n = dest.slots.shape[0]
    if any(s.slots.shape[0] != n for s in sources):
        raise ValueError(f"every source must hold the destination's {n} slots")
    for dbuf in dest.layout.buffers:
        target = buffer_view(dest.slots, dest.layout, dbuf)  # [n, tokens, heads, dim]
        wanted, filled = dest.heads(dbuf), set()
        for src in sources[:1] if replicated(dbuf.role) else sources:
            sbuf = src.buffer(dbuf.layer_id, dbuf.role)
            if (sbuf.head_dim, sbuf.dtype) != (dbuf.head_dim, dbuf.dtype):
                raise ValueError(
                    f"layer {dbuf.layer_id} {dbuf.role.value}: head_dim/dtype "
                    f"{sbuf.head_dim}/{sbuf.dtype} at the source, {dbuf.head_dim}/{dbuf.dtype} here"
                )
            held = src.heads(sbuf)
            lo, hi = max(wanted.start, held.start), min(wanted.stop, held.stop)
            if lo < hi:
                source = buffer_view(src.slots, src.layout, sbuf)
                target[:, :, lo - wanted.start : hi - wanted.start] = source[
                    :, :, lo - held.start : hi - held.start
                ]
                filled.update(range(lo, hi))
        if filled != set(wanted):
            raise ValueError(
                f"layer {dbuf.layer_id} {dbuf.role.value}: heads {sorted(set(wanted) - filled)} "
                f"are held by none of source ranks {[s.rank for s in sources]}"
            )


def source_ranks(dest_rank: int, dest_tp: int, source_tp: int) -> list[int]:
    """The ranks of a ``source_tp``-way even split that hold some of ``dest_rank``'s heads in a
    ``dest_tp``-way split (the heads' fractions ``[r/tp, (r+1)/tp)`` overlap)."""
    return [
        s
        for s in range(source_tp)
        if s * dest_tp < (dest_rank + 1) * source_tp and dest_rank * source_tp < (s + 1) * dest_tp
    ]


def attention_ranks(parallel: str) -> int:
    """Ranks that split one layer's heads in a layout (``Mapping.attn_tp_size``)."""
    attention_dp, ranks = parallel_ranks(parallel)
    return 1 if attention_dp else ranks


def peer_layouts(
    theirs: LayoutFingerprint, mine: LayoutFingerprint, my_pools: tuple[SlotLayout, ...]
) -> tuple[list[SlotLayout], bool]:
    """One rank's slot layouts of the peer, rebuilt from its fingerprint (``theirs``, a context
    server's) and this side's own (``mine``, a generation server's; ``my_pools``), and whether
    the two hold the same heads (equal splits, equal bytes: slots cross whole). A ``ValueError``
    names every difference that no head regrouping can bridge; different KV dtypes first, alone
    (every buffer differs then, and no conversion is made)."""
    if theirs.kv_dtype != mine.kv_dtype:
        raise ValueError(
            f"context server KV dtype {theirs.kv_dtype}, generation server KV dtype "
            f"{mine.kv_dtype}: KV cannot be transferred between different KV dtypes; start both "
            "with the same kv_cache_config.dtype"
        )
    same_split = attention_ranks(theirs.parallel) == attention_ranks(mine.parallel)
    shape = ("tokens_per_block", "layers", "draft_layers")
    diffs = [d for d in mine.differences(theirs) if d.split(":")[0] in shape]
    if len(theirs.pools) != len(my_pools):
        diffs.append(f"pools: {len(my_pools)} here vs {len(theirs.pools)} at the peer")
    if diffs:
        raise ValueError("; ".join(diffs))
    if same_split and [p.buffers for p in theirs.pools] == [p.buffers for p in mine.pools]:
        return list(my_pools), True
    return [
        _peer_pool(pool, slot, theirs, mine) for pool, slot in zip(theirs.pools, my_pools)
    ], False


def _peer_pool(pool, slot: SlotLayout, theirs: LayoutFingerprint, mine: LayoutFingerprint):
    names = [(b[0], b[1], b[4]) for b in pool.buffers]
    if names != [(b.layer_id, b.role.value, b.dtype) for b in slot.buffers]:
        raise ValueError(
            f"pool {slot.pool_index}: the peer's buffers {names} are not this side's "
            f"{[(b.layer_id, b.role.value, b.dtype) for b in slot.buffers]}"
        )
    their_ranks, my_ranks = attention_ranks(theirs.parallel), attention_ranks(mine.parallel)
    placed = []
    for (_, _, offset, size, _), buf in zip(pool.buffers, slot.buffers):
        per_head = theirs.tokens_per_block * buf.head_dim * buf.itemsize
        heads, rest = divmod(size, per_head)
        what = f"pool {slot.pool_index} layer {buf.layer_id} {buf.role.value}"
        if rest or not heads:
            raise ValueError(f"{what}: {size} bytes at the peer is not whole heads of {per_head}")
        if replicated(buf.role) and heads != buf.num_heads:
            raise ValueError(f"{what}: {heads} heads at the peer, {buf.num_heads} here")
        if not replicated(buf.role) and heads * their_ranks != buf.num_heads * my_ranks:
            hint = (
                "; KV heads replicated over ranks (fewer KV heads than ranks) cross only between "
                "servers of the same layout"
                if their_ranks != my_ranks
                else ""
            )
            raise ValueError(
                f"{what}: {heads} heads x {their_ranks} ranks at the peer ({theirs.parallel}), "
                f"{buf.num_heads} x {my_ranks} here ({mine.parallel}){hint}"
            )
        placed.append(dataclasses.replace(buf, offset=offset, size=size, num_heads=heads))
    return dataclasses.replace(slot, slot_bytes=pool.slot_bytes, buffers=tuple(placed))
