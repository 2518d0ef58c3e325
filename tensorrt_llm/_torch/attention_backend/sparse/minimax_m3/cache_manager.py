"""MiniMaxM3KVCacheManagerV2: the KV cache of a MiniMax-M3 model, with the Eagle3 drafter inside it.

Every slot holds each target layer's K and V, the indexer's index-K on the sparse layers only
(wherever ``layer_types`` puts them), and, in unified mode, the drafter's layer:

- one-model Eagle3's K and V, which differ in size from every M3 buffer: sub-pages of the same
  slot, read by the drafter's attention through ``draft_subpage_view`` at its own kernel page size;
- an MTP module's K, V and index-K: one more sparse layer of the target's geometry, in whole pages,
  attended as the target's layers are (no view).

Either way the block life cycle (prefix reuse, eviction, disaggregated transfer) covers the
drafter's KV with no extra code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.draft_subpage_view import (
    MiniMaxM3DraftSubpageView,
    resolve_subpage_tokens,
)
from tensorrt_llm._torch.pyexecutor.config import KVCacheManagerV2Config
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm.logger import logger


@dataclass(frozen=True)
class SharedDraftLayout:
    num_target_layers: int
    draft_layer_ids: tuple[int, ...]


def derive_shared_draft_layout(
    num_layers: int, num_kv_heads_per_layer: Sequence[int], num_one_model_draft_layers: int
) -> SharedDraftLayout:
    """Where the appended one-model draft layers are, anchored on the per-layer KV-heads list.

    The list's length is the one unambiguous total (target + draft layers): creation sites pass
    ``num_layers`` either as the target count or already draft-extended, and both must give the same
    answer. The draft layers are the last ``num_one_model_draft_layers`` entries.
    """
    total = len(num_kv_heads_per_layer)
    if not 0 <= num_one_model_draft_layers <= total:
        raise ValueError(
            f"num_one_model_draft_layers={num_one_model_draft_layers} out of range for {total} layers"
        )
    num_target = total - num_one_model_draft_layers
    if num_layers not in (num_target, total):
        raise ValueError(
            f"num_layers={num_layers} matches neither the target count {num_target} nor the draft-extended "
            f"count {total} of the per-layer num_kv_heads list"
        )
    return SharedDraftLayout(num_target, tuple(range(num_target, total)))


def _whole_page_draft(config: KVCacheManagerV2Config, shared: SharedDraftLayout) -> bool:
    """Whether the draft layers are whole-page layers: an MTP module's, a sparse layer of the
    target's geometry (K, V and index-K in whole pages of the slot). An Eagle3 drafter's layer has
    no index-K and its own geometry: a sub-page of the slot, read through the view."""

    def geometry(layer) -> tuple[int, int, int]:
        return layer.num_kv_heads, layer.head_dim, layer.index_head_dim

    if not any(config.layers[i].index_head_dim for i in shared.draft_layer_ids):
        return False
    targets = config.layers[: shared.num_target_layers]
    sparse = {geometry(layer) for layer in targets if layer.index_head_dim}
    bad = [i for i in shared.draft_layer_ids if geometry(config.layers[i]) not in sparse]
    if bad:
        raise ValueError(
            f"draft layers {bad}: a draft layer with an index-K buffer must have the geometry of "
            f"a target sparse layer (one of {sorted(sparse)}), as an MTP module's layer has"
        )
    return True


class MiniMaxM3KVCacheManagerV2(KVCacheManagerV2):
    supports_shared_draft_layers = True

    def __init__(self, config: KVCacheManagerV2Config) -> None:
        shared = derive_shared_draft_layout(
            config.num_layers,
            [layer.num_kv_heads for layer in config.layers],
            config.num_draft_layers,
        )
        self.shared_draft_layout = shared
        self.sparse_layer_ids = tuple(
            i for i, layer in enumerate(config.layers) if layer.index_head_dim
        )
        self.whole_page_draft = _whole_page_draft(config, shared)
        self.draft_subpage_tokens = (
            resolve_subpage_tokens(config.tokens_per_block)
            if shared.draft_layer_ids and not self.whole_page_draft
            else None
        )
        self._draft_subpage_view: MiniMaxM3DraftSubpageView | None = None
        super().__init__(config)
        if self.local_draft_layer_ids:
            sparse = list(self.sparse_layer_ids) if self.sparse_layer_ids else "none"
            reads = (
                "whole pages, as the target's layers"
                if self.whole_page_draft
                else f"draft kernel pages of {self.draft_subpage_tokens} tokens"
            )
            logger.info(
                "[unified-kv] draft layers %s share the target KV cache manager (sparse layers %s); "
                "slot_bytes=%d, %s",
                list(self.local_draft_layer_ids),
                sparse,
                self.slot_bytes(),
                reads,
            )

    @property
    def local_draft_layer_ids(self) -> tuple[int, ...]:
        """Draft layers whose KV this manager holds (none for a separate draft manager's target)."""
        if self.is_draft:
            return ()
        return tuple(i for i in self.pp_layers if i in self.shared_draft_layout.draft_layer_ids)

    def _storage_options(self) -> dict:
        # Pad slots so the draft buffers split into whole kernel pages (the view needs it).
        return (
            {"kernel_page_tokens": self.draft_subpage_tokens} if self.draft_subpage_tokens else {}
        )

    @property
    def draft_subpage_view(self) -> MiniMaxM3DraftSubpageView | None:
        """The draft layers' KV as kernel pages: built on first use and cached; ``None`` for a draft
        manager, when no draft layer is local, or for whole-page draft layers (an MTP module's,
        attended as the target's layers are). Construction errors propagate."""
        if self.is_draft or not self.local_draft_layer_ids or self.whole_page_draft:
            return None
        if self._draft_subpage_view is None:
            self._draft_subpage_view = MiniMaxM3DraftSubpageView(
                self.host_block_table,
                self.layout,
                self.pools,
                self.local_draft_layer_ids,
                self.tokens_per_block,
                self.draft_subpage_tokens,
            )
        return self._draft_subpage_view
