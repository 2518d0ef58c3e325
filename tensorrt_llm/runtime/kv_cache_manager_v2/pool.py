"""Pool tensors and zero-copy buffer views. The only module of the engine that imports torch.

A pool is one byte tensor ``[num_slots, slot_bytes]`` (CPU or CUDA). Every view below is a strided
alias of it (``torch.as_strided``): writing through a view writes the pool, and no view copies.
"""

from __future__ import annotations

import torch

from tensorrt_llm.runtime.kv_cache_manager_v2.config import DataRole
from tensorrt_llm.runtime.kv_cache_manager_v2.layout import (
    BufferPlacement,
    SlotLayout,
    StorageLayout,
)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={name!r} is not a torch dtype")
    return dtype


def allocate_pools(
    layout: StorageLayout, num_slots: int, device: torch.device | str
) -> list[torch.Tensor]:
    """One zero-filled ``[num_slots, slot_bytes]`` uint8 tensor per life cycle, in pool order."""
    return [
        torch.zeros(num_slots, pool.slot_bytes, dtype=torch.uint8, device=device)
        for pool in layout.pools
    ]


def _typed(pool: torch.Tensor, buf: BufferPlacement) -> tuple[torch.Tensor, int, int]:
    """The pool as ``buf``'s dtype, the slot stride and the buffer's storage offset, both in
    elements (``pool`` may itself be a slice of a larger tensor: ``as_strided`` counts from the
    start of the storage)."""
    typed = pool.view(torch_dtype(buf.dtype))  # [num_slots, slot_bytes // itemsize]
    return typed, typed.stride(0), typed.storage_offset() + buf.offset // buf.itemsize


def buffer_view(pool: torch.Tensor, slot: SlotLayout, buf: BufferPlacement) -> torch.Tensor:
    """``[num_slots, tokens_per_block, num_heads, head_dim]`` view of one buffer in every slot."""
    typed, slot_stride, offset = _typed(pool, buf)
    tpb = buf.size // (buf.num_heads * buf.head_dim * buf.itemsize)
    h, d = buf.num_heads, buf.head_dim
    return typed.as_strided((pool.shape[0], tpb, h, d), (slot_stride, h * d, d, 1), offset)


def kv_view(pool: torch.Tensor, slot: SlotLayout, key: BufferPlacement) -> torch.Tensor:
    """``[num_slots, 2, tokens_per_block, num_kv_heads, head_dim]`` view of a layer's K (lane 0) and V
    (lane 1); given the ``key_scale`` placement, ``[num_slots, 2, tokens_per_block, num_kv_heads, 1]``
    of their scales. Relies on V starting right where K ends (layout rule 2)."""
    pair = DataRole.VALUE_SCALE if key.role is DataRole.KEY_SCALE else DataRole.VALUE
    value = next(b for b in slot.buffers if b.layer_id == key.layer_id and b.role is pair)
    if value.offset != key.end:
        raise AssertionError(
            f"layer {key.layer_id}: {pair.value} at {value.offset} does not follow "
            f"{key.role.value} at {key.end}"
        )
    typed, slot_stride, offset = _typed(pool, key)
    h, d = key.num_heads, key.head_dim
    tpb = key.size // (h * d * key.itemsize)
    return typed.as_strided(
        (pool.shape[0], 2, tpb, h, d), (slot_stride, tpb * h * d, h * d, d, 1), offset
    )


def page_scale_view(
    pool: torch.Tensor, slot: SlotLayout, scale: BufferPlacement, page_tokens: int, num_pages: int
) -> torch.Tensor:
    """``[num_slots, num_pages, page_tokens, num_heads]`` float32 view of the scales of a slot's
    ``page_tokens``-token pages, from the scale buffer ``scale`` on (``num_pages`` may run on into
    the buffers that follow it: V's scales after K's)."""
    typed, slot_stride, offset = _typed(pool, scale)
    h = scale.num_heads
    return typed.as_strided(
        (pool.shape[0], num_pages, page_tokens, h), (slot_stride, page_tokens * h, h, 1), offset
    )
