"""Storage planning: life cycles -> one slot layout each -> every buffer at a fixed byte offset. torch-free.

One slot holds one logical block of every buffer of a life cycle, back to back, in layer order::

    offset 0                                                                   slot_bytes
    | L0.key | L0.value | pad | L1.key | L1.value | pad | L1.index_key | ... | D.key | D.value | pad |
      ^ a multiple of alignment_bytes        ^ value starts where key ends (no gap), so a layer's
                                               K and V form one [2, tokens_per_block, H, D] block

With a scaled dtype (FP8) each layer also holds its scales, K's and V's adjacent like the rows::

    | L1.key | L1.value | pad | L1.key_scale | L1.value_scale | pad | L1.index_key | pad | L1.index_key_scale | pad |

Rules (each is pinned by tests/unittest/runtime/kv_cache_manager_v2/test_layout.py):

1. Layers in ascending ``layer_id``; inside a layer: key, value, key_scale, value_scale, index_key,
   index_key_scale (those it has).
2. Every buffer but value and value_scale starts at a multiple of ``alignment_bytes``; value starts
   right after key, value_scale right after key_scale. Within a buffer, a block is ``[tokens_per_block, num_heads, head_dim]`` row-major (NHD), so
   ``kernel_page_tokens`` consecutive tokens form one contiguous kernel page.
3. ``slot_bytes`` is the end of the last buffer rounded up to a multiple of ``alignment_bytes`` and of
   every buffer's kernel-page bytes (``kernel_page_tokens * bytes_per_token``). Hence every buffer can
   be viewed as its dtype with a slot stride of ``slot_bytes``, and any buffer can be addressed as
   kernel pages of a fixed size rooted at its own offset (page ``s * slot_bytes // page_bytes + j``).
4. The **page size class** of a life cycle is the per-block size shared by the most buffers (ties go to
   the larger size). Buffers of any other size are **sub-pages**: they live in the same slot, at their
   own offsets, and are read through views that know their geometry (index-K, the Eagle3 draft layer).

One pool per life cycle, ``[num_slots, slot_bytes]`` bytes (see ``pool.py``). Every life cycle keeps
all of its blocks, so one slot id addresses the same logical block in every pool.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from tensorrt_llm.runtime.kv_cache_manager_v2.config import DataRole, KVCacheManagerConfig

_ROLE_ORDER = (
    DataRole.KEY,
    DataRole.VALUE,
    DataRole.KEY_SCALE,
    DataRole.VALUE_SCALE,
    DataRole.INDEX_KEY,
    DataRole.INDEX_KEY_SCALE,
)


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class BufferPlacement:
    """Where one buffer lives inside a slot. ``offset`` and ``size`` are bytes; ``size`` is per block."""

    layer_id: int
    role: DataRole
    offset: int
    size: int
    num_heads: int
    head_dim: int
    dtype: str
    itemsize: int
    is_subpage: bool

    @property
    def end(self) -> int:
        return self.offset + self.size

    def kernel_page_bytes(self, page_tokens: int) -> int:
        return page_tokens * self.num_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class SlotLayout:
    """The slot of one life cycle, stored in pool ``pool_index``."""

    life_cycle: str
    pool_index: int
    slot_bytes: int
    page_size: int  # bytes per block of the page size class
    buffers: tuple[BufferPlacement, ...]

    @property
    def used_bytes(self) -> int:
        return sum(b.size for b in self.buffers)


@dataclass(frozen=True)
class StorageLayout:
    tokens_per_block: int
    kernel_page_tokens: int
    alignment_bytes: int
    pools: tuple[SlotLayout, ...]

    def placement(self, layer_id: int, role: DataRole | str) -> tuple[SlotLayout, BufferPlacement]:
        role = DataRole(role)
        for pool in self.pools:
            for buf in pool.buffers:
                if buf.layer_id == layer_id and buf.role is role:
                    return pool, buf
        raise KeyError(f"no buffer ({layer_id}, {role.value!r}) in this layout")

    def has(self, layer_id: int, role: DataRole | str) -> bool:
        try:
            self.placement(layer_id, role)
        except KeyError:
            return False
        return True

    def pool_of_layer(self, layer_id: int) -> int:
        return self.placement(layer_id, DataRole.KEY)[0].pool_index

    def describe(self) -> str:
        """A table of every buffer of every slot: what users read when a layout surprises them."""
        lines = [
            f"KV cache slot layout: tokens_per_block={self.tokens_per_block} "
            f"kernel_page_tokens={self.kernel_page_tokens} alignment_bytes={self.alignment_bytes}"
        ]
        for pool in self.pools:
            pad = pool.slot_bytes - pool.used_bytes
            lines.append(
                f"pool {pool.pool_index} (life cycle {pool.life_cycle!r}): slot_bytes={pool.slot_bytes} "
                f"used={pool.used_bytes} padding={pad} page_size={pool.page_size}"
            )
            header = f"  {'layer':>5} {'role':<15} {'offset':>10} {'bytes':>10} {'heads x dim':>12} {'dtype':<14} class"
            lines.append(header)
            for b in pool.buffers:
                cls = "sub-page" if b.is_subpage else "page"
                geom = f"{b.num_heads}x{b.head_dim}"
                lines.append(
                    f"  {b.layer_id:>5} {b.role.value:<15} {b.offset:>10} {b.size:>10} {geom:>12} {b.dtype:<14} {cls}"
                )
        return "\n".join(lines)


def plan_storage(config: KVCacheManagerConfig) -> StorageLayout:
    """Place every buffer of every layer; see the module docstring for the rules."""
    tpb, align = config.tokens_per_block, config.alignment_bytes
    life_cycles: list[str] = []
    for layer in config.layers:
        if layer.life_cycle not in life_cycles:
            life_cycles.append(layer.life_cycle)

    pools = []
    for pool_index, life_cycle in enumerate(life_cycles):
        members = [layer for layer in config.layers if layer.life_cycle == life_cycle]
        sizes = Counter(b.bytes_per_token * tpb for layer in members for b in layer.buffers)
        page_size = max(sizes, key=lambda size: (sizes[size], size))

        placed: list[BufferPlacement] = []
        cursor = 0
        for layer in members:
            for role in _ROLE_ORDER:
                if not layer.has(role):
                    continue
                buf = layer.buffer(role)
                if role not in (DataRole.VALUE, DataRole.VALUE_SCALE):
                    cursor = align_up(cursor, align)
                size = buf.bytes_per_token * tpb
                placed.append(
                    BufferPlacement(
                        layer_id=layer.layer_id,
                        role=role,
                        offset=cursor,
                        size=size,
                        num_heads=buf.num_heads,
                        head_dim=buf.head_dim,
                        dtype=buf.dtype,
                        itemsize=buf.itemsize,
                        is_subpage=size != page_size,
                    )
                )
                cursor += size

        slot_multiple = align
        for b in placed:
            slot_multiple = math.lcm(slot_multiple, b.kernel_page_bytes(config.kernel_page_tokens))
        pools.append(
            SlotLayout(
                life_cycle=life_cycle,
                pool_index=pool_index,
                slot_bytes=align_up(cursor, slot_multiple),
                page_size=page_size,
                buffers=tuple(placed),
            )
        )
    return StorageLayout(tpb, config.kernel_page_tokens, align, tuple(pools))
