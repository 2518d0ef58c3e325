"""VanillaAttentionBackend (``attn_backend="VANILLA"``): the torch reference behind the interface.

The CPU path and the oracle every other backend is checked against. Paged only: every call reads
and writes KV through the manager attached to the step's metadata (``reference.py``); its sparse layers' MSA is
``sparse/minimax_m3/msa.py``.
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.reference import paged_attention


class VanillaAttentionBackend(AttentionBackend):
    name = "VANILLA"

    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata | None,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention(layer_idx, q, k, v, self.paged_metadata(metadata), scale)
