"""MiniMaxM3DraftSubpageView: the Eagle3 draft layer's KV, inside the shared slots, as kernel pages.

The M3 manager packs each logical block's K, V, index-K and the draft layer's K and V into one slot.
The draft attention kernels want ``subpage_tokens``-token pages (32 by default), so the view presents
the same bytes as a page space rooted at the draft layer's K of slot 0::

    page p  =  bytes [p * page_bytes, (p + 1) * page_bytes)  from  pool_base + draft_k_offset
    page_bytes = subpage_tokens * draft bytes_per_token          subdiv = tokens_per_block / subpage_tokens
    slot_units = slot_bytes / page_bytes                         (the slot stride in pages)

    logical block table entry s (a slot id)  ->  K pages  s * slot_units + j
                                                 V pages  s * slot_units + subdiv + j,   j < subdiv

    slot s:  |.. target K/V, index-K ..| draft K: j=0 1 2 3 | draft V: j=0 1 2 3 |.. pad ..|
             ^ s*slot_units pages from the re-rooted base    ^ + subdiv pages

In an FP8 cache each page's rows have float32 scales in the draft layer's scale buffers, K's then
V's, page for page (``get_kv_scales``: page p's at ``[p // slot_units, p % slot_units]``).

Table entries past a row's blocks hold slot 0, so they expand to slot 0's pages: inert, since kernels
never read past a row's length. The view owns no blocks. It is built from what it reads (the host
block table, the slot layout, the pool tensor, the draft layer ids) and declares every member the
attention side reads (``PagedKVCache`` in ``attention_backend/interface.py``) and nothing else:
reading any other name raises ``AttributeError`` instead of reaching the manager's 128-token data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorrt_llm import envs
from tensorrt_llm._torch.attention_backend.interface import ScalePages
from tensorrt_llm.logger import logger
from tensorrt_llm.runtime.kv_cache_manager_v2 import DataRole, StorageLayout
from tensorrt_llm.runtime.kv_cache_manager_v2.config import is_power_of_two
from tensorrt_llm.runtime.kv_cache_manager_v2.host_block_table import HostBlockTable
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import page_scale_view, torch_dtype

DEFAULT_SUBPAGE_TOKENS = 32


def resolve_subpage_tokens(tokens_per_block: int) -> int:
    """The draft kernel page size: ``TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK`` if set, else 32 (or the
    block size, if smaller). Raises ``ValueError`` naming the variable for an invalid value."""
    value = envs.TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK.get()
    if value is None:
        return min(DEFAULT_SUBPAGE_TOKENS, tokens_per_block)
    if not is_power_of_two(value) or tokens_per_block % value:
        raise ValueError(
            f"TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK={value} must be a power of two dividing "
            f"tokens_per_block={tokens_per_block}"
        )
    return value


class MiniMaxM3DraftSubpageView:
    __slots__ = (
        "_host_table",
        "_pool",
        "_key_offsets",
        "_scales",
        "_geometry",
        "_lane_offsets",
        "draft_layer_ids",
        "subpage_tokens",
        "subdiv",
        "page_bytes",
        "slot_units",
        "tokens_per_block",
        "max_blocks_per_seq",
        "blocks_in_primary_pool",
    )
    num_pools = 1

    def __init__(
        self,
        host_table: HostBlockTable,
        layout: StorageLayout,
        pools: Sequence[torch.Tensor],
        draft_layer_ids: Sequence[int],
        tokens_per_block: int,
        subpage_tokens: int = DEFAULT_SUBPAGE_TOKENS,
    ) -> None:
        """``host_table`` / ``layout`` / ``pools`` are the owning manager's (read, never written);
        ``tokens_per_block`` is its logical block size."""
        tpb = tokens_per_block
        if not draft_layer_ids:
            raise ValueError("a draft sub-page view needs at least one draft layer")
        if not is_power_of_two(subpage_tokens) or tpb % subpage_tokens:
            raise ValueError(
                f"subpage_tokens={subpage_tokens} must be a power of two dividing tokens_per_block={tpb}"
            )
        if len(pools) != 1:
            raise ValueError(
                f"the draft sub-page view needs a single-pool KV cache; this one has {len(pools)} pools"
            )
        key = _draft_key_placement(layout, draft_layer_ids)
        self._host_table = host_table
        self._pool = pools[0]
        self.draft_layer_ids = tuple(draft_layer_ids)
        self.subpage_tokens = subpage_tokens
        self.subdiv = tpb // subpage_tokens
        self.page_bytes = key.size // self.subdiv
        slot_bytes = layout.pools[0].slot_bytes
        if slot_bytes % self.page_bytes:
            raise ValueError(
                f"slot_bytes={slot_bytes} is not a whole number of {subpage_tokens}-token draft pages "
                f"({self.page_bytes} bytes); plan the layout with kernel_page_tokens={subpage_tokens}"
            )
        self.slot_units = slot_bytes // self.page_bytes
        self.tokens_per_block = subpage_tokens
        self.max_blocks_per_seq = host_table.max_blocks_per_seq * self.subdiv
        self._key_offsets = {
            layer: layout.placement(layer, DataRole.KEY)[1].offset for layer in self.draft_layer_ids
        }
        self._scales = {
            layer: _scale_pages(layout, self._pool, layer, subpage_tokens, self)
            for layer in self.draft_layer_ids
        }
        # Pages from the re-rooted base (the first draft layer's K of slot 0) to the pool's end.
        self.blocks_in_primary_pool = (self._pool.numel() - key.offset) // self.page_bytes
        self._geometry = (key.num_heads, key.head_dim, key.dtype, key.itemsize)
        # [2, subdiv]: page offsets of K (j) and V (subdiv + j) inside a slot
        self._lane_offsets = torch.stack(
            [torch.arange(self.subdiv), self.subdiv + torch.arange(self.subdiv)]
        ).to(self._pool.device)
        logger.info(
            "[unified-kv] draft subpage view active: draft_layers=%s subdiv=%d tokens_per_block=%d "
            "slot_units=%d page_bytes=%d",
            list(self.draft_layer_ids),
            self.subdiv,
            self.tokens_per_block,
            self.slot_units,
            self.page_bytes,
        )

    # ---- the paged-KV contract ---------------------------------------------------------------
    def layer_pool_index(self, layer_idx: int) -> int:
        self._check_layer(layer_idx)
        return 0

    def get_kv_pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_pages, subpage_tokens, heads, head_dim]``, one page space for K and V alike (the
        block table's lanes tell them apart)."""
        self._check_layer(layer_idx)
        heads, head_dim, dtype, itemsize = self._geometry
        typed = self._pool.view(torch_dtype(dtype)).view(-1)
        offset = self._key_offsets[layer_idx]
        num_pages = (typed.numel() * itemsize - offset) // self.page_bytes
        pages = typed.as_strided(
            (num_pages, self.subpage_tokens, heads, head_dim),
            (self.page_bytes // itemsize, heads * head_dim, head_dim, 1),
            offset // itemsize,
        )
        return pages, pages

    def get_kv_scales(self, layer_idx: int) -> tuple[ScalePages, ScalePages] | None:
        """In an FP8 cache, the scales of the page space (one tensor for K and V: V's scale pages
        follow K's in the slot as V's pages follow K's); else ``None``."""
        self._check_layer(layer_idx)
        scales = self._scales[layer_idx]
        return None if scales is None else (scales, scales)

    @property
    def kv_cache_pool_pointers(self) -> torch.Tensor:
        """``[1, 2]`` int64: the pool base re-rooted at the first draft layer's K, and 0."""
        first = self._key_offsets[self.draft_layer_ids[0]]
        return torch.tensor([[self._pool.data_ptr() + first, 0]], dtype=torch.int64)

    def copy_batch_block_offsets(
        self,
        dst_tensor: torch.Tensor,
        request_ids: Sequence[int],
        beam_width: int = 1,
        num_contexts: int = 0,
        num_seqs: int | None = None,
    ) -> None:
        """Expand the batch's slot rows into K/V page rows, ``dst[0, :n]`` ``[n, 2, max_blocks * subdiv]``,
        in one broadcast over the rows on ``dst``'s device (only the slot rows cross to a GPU:
        ``2 * subdiv`` times fewer bytes than the pages). Kernels that compute the sub-page
        address from the target's slot table need none of this (``triton/addressing.py``)."""
        del num_contexts
        device = dst_tensor.device
        slots = self._host_table.batch_slot_rows(request_ids, beam_width, num_seqs)
        slots = slots.to(device, non_blocking=device.type == "cuda").long()  # [n, max_blocks]
        n = slots.shape[0]
        lanes = self._lane_offsets.to(device)
        pages = slots[:, None, :, None] * self.slot_units + lanes[None, :, None, :]
        dst_tensor[0, :n, :, : self.max_blocks_per_seq].copy_(
            pages.reshape(n, 2, self.max_blocks_per_seq)
        )

    def free_resources(self, request) -> None:
        """The view owns no blocks."""

    def _check_layer(self, layer_idx: int) -> None:
        if layer_idx not in self._key_offsets:
            raise KeyError(
                f"layer {layer_idx} is not a draft layer of this view {list(self.draft_layer_ids)}"
            )


def _scale_pages(
    layout: StorageLayout,
    pool: torch.Tensor,
    layer: int,
    subpage_tokens: int,
    view: MiniMaxM3DraftSubpageView,
) -> ScalePages | None:
    """The draft layer's K and V scales as ``2 * subdiv`` scale pages per slot, or ``None``."""
    if not layout.has(layer, DataRole.KEY_SCALE):
        return None
    slot, key_scale = layout.placement(layer, DataRole.KEY_SCALE)
    value_scale = layout.placement(layer, DataRole.VALUE_SCALE)[1]
    if value_scale.offset != key_scale.end:
        raise ValueError(f"draft layer {layer}: value_scale does not follow key_scale")
    tensor = page_scale_view(pool, slot, key_scale, subpage_tokens, 2 * view.subdiv)
    return ScalePages(tensor, view.slot_units)


def _draft_key_placement(layout: StorageLayout, draft_layer_ids: Sequence[int]):
    """The draft layers' K buffer placement, checked: every draft layer in pool 0, one geometry."""
    keys = []
    for layer in draft_layer_ids:
        pool, key = layout.placement(layer, DataRole.KEY)
        if pool.pool_index != 0:
            raise ValueError(
                f"draft layer {layer} lives in pool {pool.pool_index}; the view needs it in pool 0"
            )
        keys.append(key)
    if len({(k.size, k.num_heads, k.head_dim, k.dtype) for k in keys}) != 1:
        raise ValueError(
            f"draft layers {list(draft_layer_ids)} differ in geometry; one view cannot page them all"
        )
    return keys[0]
