"""``SlotViews``: a KV cache manager's pool tensors seen through its slot layout, by layer and role.

Every view is a zero-copy strided alias of a pool (``runtime/kv_cache_manager_v2/pool.py``): the
slot stride is the slot size, so writing through a view writes the pool. In an FP8 cache the rows'
float32 scales are views of the same slots (``ScalePages``: a page here is a slot).

A manager's addressing, as published to attention ops::

    pool p         kv_cache_pool_pointers[p, 0]: base address of a [num_slots, slot_bytes] byte tensor
    layer l        kv_cache_pool_mapping[l] = (pool index, byte offset of l's K inside a slot)
    block b of r   host_block_table.table[p, row(r), lane, b] = slot id (lane 0: K, lane 1: V;
                   both hold the slot id here; views with sub-page addressing fill them differently)
    K of (r,b,t)   base + slot * slot_bytes + k_offset(l) + t * bytes_per_token
    V              the same, + K's bytes per block (V follows K in the slot)

Entries past a row's last block hold slot 0: they are never read (kernels stop at the row's length).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorrt_llm._torch.attention_backend.interface import ScalePages
from tensorrt_llm.runtime.kv_cache_manager_v2 import DataRole, StorageLayout
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import buffer_view, kv_view


class SlotViews:
    def __init__(self, layout: StorageLayout, pools: Sequence[torch.Tensor]) -> None:
        self.layout = layout
        self.pools = pools

    def kv(self, layer_idx: int) -> torch.Tensor:
        """``[num_slots, 2, tokens_per_block, num_kv_heads, head_dim]``: K (lane 0) and V (lane 1)."""
        return self._pair(layer_idx, DataRole.KEY)

    def index_k(self, layer_idx: int) -> torch.Tensor:
        """``[num_slots, tokens_per_block, index_heads, index_head_dim]``."""
        if not self.layout.has(layer_idx, DataRole.INDEX_KEY):
            raise KeyError(f"layer {layer_idx} has no index_key buffer")
        return self._buffer(layer_idx, DataRole.INDEX_KEY)

    def kv_scales(self, layer_idx: int) -> tuple[ScalePages, ScalePages] | None:
        """K's and V's row scales in an FP8 cache (``[num_slots, 1, tokens_per_block, heads]``
        each), else ``None``."""
        if not self.layout.has(layer_idx, DataRole.KEY_SCALE):
            return None
        kv = self._pair(layer_idx, DataRole.KEY_SCALE)[..., 0]
        return ScalePages(kv[:, 0, None]), ScalePages(kv[:, 1, None])

    def index_k_scales(self, layer_idx: int) -> ScalePages | None:
        """Index-K's row scales in an FP8 cache, else ``None``."""
        if not self.layout.has(layer_idx, DataRole.INDEX_KEY_SCALE):
            return None
        return ScalePages(self._buffer(layer_idx, DataRole.INDEX_KEY_SCALE)[:, None, ..., 0])

    def pool_mapping(self, layer_ids: Sequence[int]) -> torch.Tensor:
        """``[len(layer_ids), 2]`` int32: (pool index, byte offset of the layer's K in a slot)."""
        rows = []
        for layer_id in layer_ids:
            pool, key = self.layout.placement(layer_id, DataRole.KEY)
            rows.append([pool.pool_index, key.offset])
        return torch.tensor(rows, dtype=torch.int32)

    def _pair(self, layer_idx: int, first: DataRole) -> torch.Tensor:
        pool, buf = self.layout.placement(layer_idx, first)
        return kv_view(self.pools[pool.pool_index], pool, buf)

    def _buffer(self, layer_idx: int, role: DataRole) -> torch.Tensor:
        pool, buf = self.layout.placement(layer_idx, role)
        return buffer_view(self.pools[pool.pool_index], pool, buf)
