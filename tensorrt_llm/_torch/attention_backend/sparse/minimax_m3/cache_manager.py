"""MiniMaxM3KVCacheManagerV2: the KV cache of a MiniMax-M3 model.

Every slot holds each layer's K and V and, on sparse (MSA) layers only, the indexer's per-token
index-K (one head of ``index_head_dim``), which is a sub-page of the slot since its size differs
from every K/V buffer. One-model Eagle3 draft layers are appended after the target layers and are
never sparse.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2


class MiniMaxM3KVCacheManagerV2(KVCacheManagerV2):
    def __init__(
        self, *args, sparse_layer_ids: Sequence[int] = (), index_head_dim: int = 0, **kwargs
    ) -> None:
        self.sparse_layer_ids = tuple(sorted(sparse_layer_ids))
        self.index_head_dim = index_head_dim
        if self.sparse_layer_ids and index_head_dim <= 0:
            raise ValueError(
                f"index_head_dim={index_head_dim} must be positive when there are sparse layers"
            )
        super().__init__(*args, **kwargs)
        drafts = [i for i in self.sparse_layer_ids if self.is_draft_layer(i)]
        if drafts:
            raise ValueError(
                f"sparse_layer_ids {drafts} are draft layers; a draft layer is never sparse"
            )

    def _index_key(self, layer_id: int) -> tuple[int, int, str] | None:
        return (1, self.index_head_dim, self.dtype) if layer_id in self.sparse_layer_ids else None
