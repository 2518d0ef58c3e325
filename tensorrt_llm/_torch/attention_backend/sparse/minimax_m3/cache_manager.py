"""MiniMaxM3KVCacheManagerV2: the KV cache of a MiniMax-M3 model, with the Eagle3 drafter inside it.

Every slot holds each target layer's K and V, the indexer's index-K on the sparse layers only
(wherever ``layer_types`` puts them), and,
with one-model Eagle3 in unified mode, the draft layer's K and V. The draft buffers differ in size
from every M3 buffer, so they are sub-pages of the same slot; the block life cycle (prefix reuse,
eviction, disaggregated transfer) therefore covers them with no extra code. The drafter's attention
reads them through ``draft_subpage_view`` at its own kernel page size.
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


class MiniMaxM3KVCacheManagerV2(KVCacheManagerV2):
    supports_shared_draft_layers = True

    def __init__(self, config: KVCacheManagerV2Config) -> None:
        shared = derive_shared_draft_layout(
            config.num_layers,
            [layer.num_kv_heads for layer in config.layers],
            config.num_draft_layers,
        )
        self.shared_draft_layout = shared
        bad = [i for i in shared.draft_layer_ids if config.layers[i].index_head_dim]
        if bad:
            raise ValueError(
                f"draft layers {bad} cannot have an index-K buffer (MSA is target-only)"
            )
        self.sparse_layer_ids = tuple(
            i for i, layer in enumerate(config.layers) if layer.index_head_dim
        )
        self.draft_subpage_tokens = (
            resolve_subpage_tokens(config.tokens_per_block) if shared.draft_layer_ids else None
        )
        self._draft_subpage_view: MiniMaxM3DraftSubpageView | None = None
        super().__init__(config)
        if self.local_draft_layer_ids:
            sparse = list(self.sparse_layer_ids) if self.sparse_layer_ids else "none"
            logger.info(
                "[unified-kv] draft layers %s share the target KV cache manager (sparse layers %s); "
                "slot_bytes=%d, draft kernel pages of %d tokens",
                list(self.local_draft_layer_ids),
                sparse,
                self.slot_bytes(),
                self.draft_subpage_tokens,
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
        manager or when no draft layer is local. Construction errors propagate."""
        if self.is_draft or not self.local_draft_layer_ids:
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
