"""TritonAttentionBackend (``attn_backend="TRITON"``): the paged backend on Triton kernels.

Same contract as ``VANILLA`` (``backend.py``): write the step's K and V through the manager attached
to the metadata, then attend, on ``ops.py``. MiniMax-M3's sparse layers attend through their
family's backend (``sparse/minimax_m3/msa_backend.py``), which writes K and V with this backend's
addressing (``paged_kv``).

The Eagle3 draft layer's KV lives in sub-pages of the target's slots. The backend reads it
- through the target's slot table with the addressing computed in the kernel (``draft_subpage_kv``),
  when the draft sub-page view is swapped in over its manager (``swap_kv_cache_manager``: every
  draft step) and ``draft_subpage_addressing`` is on; the expanded table is then never built;
- else through the view's expanded table, like any manager.
Both the write and the attention use the same addressing.
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.draft_subpage_view import (
    MiniMaxM3DraftSubpageView,
)
from tensorrt_llm._torch.attention_backend.triton.addressing import (
    PagedKV,
    draft_subpage_kv,
    plain_paged_kv,
)
from tensorrt_llm._torch.attention_backend.triton.ops import paged_attention, write_kv_pages
from tensorrt_llm._torch.attention_backend.triton.step import StepBatch


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON"
    supports_cuda_graphs = True

    def __init__(self, draft_subpage_addressing: bool = True, num_splits: int | None = None):
        """``draft_subpage_addressing``: compute the draft sub-page addresses in the kernel from the
        target's slot table when it is at hand (else read the view's expanded table).
        ``num_splits``: a fixed split-K count (e.g. under CUDA graphs); ``None``: per step."""
        if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
            raise ValueError(f"num_splits={num_splits!r} must be a positive int or None")
        self.draft_subpage_addressing = draft_subpage_addressing
        self.num_splits = num_splits

    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata | None,
        scale: float,
    ) -> torch.Tensor:
        metadata = self.paged_metadata(metadata)
        kv = self.paged_kv(metadata, layer_idx)
        write_kv_pages(k, v, kv, metadata.position_ids, metadata.token_seq_idx)
        batch = StepBatch.from_metadata(metadata)
        return paged_attention(q, kv, batch, scale, self.num_splits)

    def reads_block_table(self, metadata: AttentionMetadata) -> bool:
        return not self._addresses_subpages(metadata)

    def _addresses_subpages(self, metadata: AttentionMetadata) -> bool:
        return (
            self.draft_subpage_addressing
            and isinstance(metadata.kv_cache_manager, MiniMaxM3DraftSubpageView)
            and metadata.swapped_out is not None
        )

    def paged_kv(self, metadata: AttentionMetadata, layer_idx: int) -> PagedKV:
        """How this step's kernels reach ``layer_idx``'s KV (see the module docstring)."""
        manager = metadata.kv_cache_manager
        if self._addresses_subpages(metadata):
            slot_manager, slot_offsets = metadata.swapped_out
            return draft_subpage_kv(manager, layer_idx, slot_manager, slot_offsets)
        return plain_paged_kv(manager, layer_idx, metadata.kv_cache_block_offsets)
