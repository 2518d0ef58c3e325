"""Where a Triton kernel finds KV position ``p`` of sequence ``s``: ``PageAddressing``, ``PagedKV``.

One formula covers every cache the backend meets (``lane`` 0 is K, 1 is V)::

    entry  = block_table[s, lane, p // block_tokens]          a table entry covers block_tokens
    page   = entry * page_units + lane * v_page_offset + (p % block_tokens) // page_tokens
    row    = p % page_tokens                                  the token's row inside its page

    plain: the attached manager's own table        block_tokens = page_tokens = tokens_per_block
      (a KVCacheManagerV2, or the draft sub-page   page_units = 1, v_page_offset = 0
       view with its expanded table)
    sub-page: the draft layer read from the        block_tokens = the target's 128
      TARGET's slot table (both lanes hold the     page_tokens = subpage_tokens (32)
      slot id)                                     page_units = slot_units, v_page_offset = subdiv

    so with sub-page addressing slot s gives K pages s*slot_units + j, V pages s*slot_units + subdiv
    + j, j = (p % 128) // 32: the view's expansion (``draft_subpage_view.py``), done in the kernel.

Nothing here imports Triton; the kernels take these numbers as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm._torch.attention_backend.interface import PagedKVCache, ScalePages
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.draft_subpage_view import (
    MiniMaxM3DraftSubpageView,
)


@dataclass(frozen=True)
class PageAddressing:
    block_tokens: int  # KV positions per block-table entry
    page_tokens: int  # token rows per page of the page tensors
    page_units: int = 1  # pages between consecutive table entries' first pages
    v_page_offset: int = 0  # added to V's page (the view: V sub-pages follow the K sub-pages)

    def __post_init__(self) -> None:
        for name in ("block_tokens", "page_tokens", "page_units"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"PageAddressing.{name}={value} must be positive")
        if self.block_tokens % self.page_tokens:
            raise ValueError(
                f"PageAddressing.block_tokens={self.block_tokens} is not a multiple of "
                f"page_tokens={self.page_tokens}"
            )

    @classmethod
    def plain(cls, tokens_per_block: int) -> PageAddressing:
        """One page per table entry: ``page = block_table[s, lane, p // tokens_per_block]``."""
        return cls(tokens_per_block, tokens_per_block)

    @classmethod
    def draft_subpages(cls, view: MiniMaxM3DraftSubpageView) -> PageAddressing:
        """The view's sub-pages computed from the target's slot table (see the module docstring)."""
        return cls(
            view.subpage_tokens * view.subdiv, view.subpage_tokens, view.slot_units, view.subdiv
        )


@dataclass(frozen=True)
class PagedKV:
    """One layer's paged K and V as a kernel reads them (pool already selected)."""

    k_pages: torch.Tensor  # [num_pages, page_tokens, num_kv_heads, head_dim]
    v_pages: torch.Tensor  # the same shape; may be k_pages itself (one page space, as the view)
    block_table: torch.Tensor  # [num_seqs, 2, max_blocks] int32, lane 0 K, lane 1 V
    addressing: PageAddressing
    # FP8 pages: K's and V's row scales (one stride set: ``scale_strides``); None otherwise
    k_scales: ScalePages | None = None
    v_scales: ScalePages | None = None

    def __post_init__(self) -> None:
        if (self.k_scales is None) != (self.v_scales is None):
            raise ValueError("k_scales and v_scales must be given together")
        if self.k_scales is not None:
            k, v = self.k_scales, self.v_scales
            if k.tensor.stride()[:3] != v.tensor.stride()[:3] or k.page_units != v.page_units:
                raise ValueError("K's and V's scale pages must share strides and page units")
        if self.k_pages.dim() != 4 or self.k_pages.shape != self.v_pages.shape:
            raise ValueError(
                f"k_pages {tuple(self.k_pages.shape)} and v_pages {tuple(self.v_pages.shape)} must "
                "both be [num_pages, page_tokens, num_kv_heads, head_dim]"
            )
        if self.k_pages.dtype != self.v_pages.dtype:
            raise ValueError(
                f"k_pages {self.k_pages.dtype} and v_pages {self.v_pages.dtype} differ"
            )
        if self.k_pages.shape[1] != self.addressing.page_tokens:
            raise ValueError(
                f"pages hold {self.k_pages.shape[1]} tokens but "
                f"addressing.page_tokens={self.addressing.page_tokens}"
            )
        table = self.block_table
        if table.dim() != 3 or table.shape[1] != 2 or table.dtype != torch.int32:
            raise ValueError(
                f"block_table {tuple(table.shape)} {table.dtype} must be [num_seqs, 2, max_blocks] "
                "int32"
            )

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def scaled(self) -> bool:
        return self.k_scales is not None

    def scale_args(self) -> tuple:
        """What a kernel takes for the scales: K's and V's tensors, ``page_units``, and the slot,
        page and row strides (dummies, never read, for unscaled pages)."""
        if self.k_scales is None:
            return (self.k_pages, self.v_pages, 1, 0, 0, 0)
        stride_slot, stride_page, stride_row = self.k_scales.tensor.stride()[:3]
        return (
            self.k_scales.tensor,
            self.v_scales.tensor,
            self.k_scales.page_units,
            stride_slot,
            stride_page,
            stride_row,
        )

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]


def plain_paged_kv(manager: PagedKVCache, layer_idx: int, block_offsets: torch.Tensor) -> PagedKV:
    """``layer_idx`` of any paged-KV manager (or view) through its own table ``block_offsets``
    ``[num_pools, num_seqs, 2, max_blocks]`` (the metadata's ``kv_cache_block_offsets``)."""
    k_pages, v_pages = manager.get_kv_pages(layer_idx)
    table = block_offsets[manager.layer_pool_index(layer_idx)]
    scales = manager.get_kv_scales(layer_idx) or (None, None)
    return PagedKV(k_pages, v_pages, table, PageAddressing.plain(manager.tokens_per_block), *scales)


def index_k_paged_kv(manager, layer_idx: int, block_offsets: torch.Tensor) -> PagedKV:
    """A sparse layer's index-K pages ``[num_pages, tokens_per_block, 1, Di]`` as the K lane of a
    ``PagedKV`` (addressed like K, through lane 0 of the layer's table; with their scales in an
    FP8 cache), for ``write_kv_pages`` with no V."""
    pages = manager.get_index_k_pages(layer_idx)
    table = block_offsets[manager.layer_pool_index(layer_idx)]
    scales = manager.get_index_k_scales(layer_idx)  # None but in an FP8 cache
    return PagedKV(
        pages, pages, table, PageAddressing.plain(manager.tokens_per_block), scales, scales
    )


def draft_subpage_kv(
    view: MiniMaxM3DraftSubpageView,
    layer_idx: int,
    slot_manager: PagedKVCache,
    slot_offsets: torch.Tensor,
) -> PagedKV:
    """The draft layer ``layer_idx`` through the view's page tensor, addressed from the slot table
    ``slot_offsets`` ``[num_pools, num_seqs, 2, max_slots]`` of ``slot_manager``, the manager that
    owns the view's slots: no expanded table is read. ``ValueError`` if it is not that manager."""
    pages, _ = view.get_kv_pages(layer_idx)  # one page space: K and V differ by address only
    slot_pages, _ = slot_manager.get_kv_pages(layer_idx)
    block_tokens = view.subpage_tokens * view.subdiv
    if (
        slot_manager.tokens_per_block != block_tokens
        or slot_offsets.shape[-1] * view.subdiv != view.max_blocks_per_seq
        or slot_pages.untyped_storage().data_ptr() != pages.untyped_storage().data_ptr()
    ):
        raise ValueError(
            f"{type(slot_manager).__name__} (tokens_per_block={slot_manager.tokens_per_block}, "
            f"{slot_offsets.shape[-1]} blocks per row) does not own the slots of this draft view "
            f"({block_tokens}-token slots, {view.max_blocks_per_seq} sub-pages per row)"
        )
    scales = view.get_kv_scales(layer_idx) or (None, None)
    return PagedKV(pages, pages, slot_offsets[0], PageAddressing.draft_subpages(view), *scales)
