"""What an attention op may read from a KV cache manager: the paged-KV contract.

An op never computes a byte offset of its own. It asks the manager attached to the step's metadata
for a layer's **page tensors** and reads them through the step's block table:

    k_pages, v_pages = manager.get_kv_pages(layer)   # each [num_pages, tokens_per_block, heads, head_dim]
    K of logical block b of batch row r = k_pages[block_offsets[pool, r, 0, b]]
    V of logical block b of batch row r = v_pages[block_offsets[pool, r, 1, b]]

``tokens_per_block`` is the manager's. Swapping the manager (for example for the Eagle3 draft
sub-page view) therefore changes the page size and the addressing an op sees, with no change to the op.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PagedKVCache(Protocol):
    """Every member an attention op (or a kernel launcher) may read from the manager attached to
    the step's metadata. Implemented by ``KVCacheManagerV2`` (pages = slots) and by
    ``MiniMaxM3DraftSubpageView`` (pages = 32-token sub-pages of the same slots)."""

    tokens_per_block: int  # tokens per kernel page
    max_blocks_per_seq: int  # block-table entries per row
    num_pools: int
    blocks_in_primary_pool: int  # pages addressable from the pool base, in this object's page units

    @property
    def kv_cache_pool_pointers(self) -> torch.Tensor:
        """``[num_pools, 2]`` int64: each pool's base address (page 0), and 0."""
        ...

    def get_kv_pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def layer_pool_index(self, layer_idx: int) -> int: ...

    def copy_batch_block_offsets(
        self,
        dst_tensor: torch.Tensor,
        request_ids: list[int],
        beam_width: int = 1,
        num_contexts: int = 0,
        num_seqs: int | None = None,
    ) -> None: ...


PAGED_KV_CACHE_MEMBERS = (
    "tokens_per_block",
    "max_blocks_per_seq",
    "num_pools",
    "blocks_in_primary_pool",
    "kv_cache_pool_pointers",
    "get_kv_pages",
    "layer_pool_index",
    "copy_batch_block_offsets",
)
