"""AttentionBackend: the one seam between a model and its attention ops (``attn_backend``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata


class AttentionBackend(ABC):
    """How a model's attention layers attend: the one seam between a model and its attention ops.

    A model holds one backend (``attn_backend``) and calls it from every attention layer; it never
    imports an attention op. Implementations differ in where the keys come from:

    - paged backends (``VANILLA``, later ``TRITON``): ``q, k, v`` are the step's flattened tokens
      ``[num_tokens, heads, head_dim]``; the call first writes the step's K and V at the step's
      positions through ``metadata.kv_cache_manager`` (``PagedKVCache`` in ``interface.py``), then
      attends each query to every cached key of its sequence at a position ``<=`` its own;
    - the training backend (``tensorrt_llm._torch.training``): whole sequences ``[B, T, heads,
      head_dim]`` from position 0, no cache, ``metadata`` is ``None``.

    Both return ``[..., num_heads, head_dim]`` shaped like ``q`` (``num_heads`` a multiple of
    ``num_kv_heads``: GQA). A backend may keep state between calls (the training backend collects
    the indexer loss); it must not change a model's parameters. A model family's own attention
    (MiniMax-M3's sparse layers: ``sparse/minimax_m3/msa_backend.py``) lives with the family and
    is chosen by this backend's ``name``.
    """

    name: ClassVar[str]
    # Whether a decode step on this backend can be captured in a CUDA graph: no host sync and no
    # host-to-device copy inside its ops, launches sized by ``metadata.max_kv_len``.
    supports_cuda_graphs: ClassVar[bool] = False

    @abstractmethod
    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata | None,
        scale: float,
    ) -> torch.Tensor:
        """Dense causal attention of layer ``layer_idx``.

        q: ``[..., num_heads, head_dim]``; k, v: ``[..., num_kv_heads, head_dim]`` -> ``[..., num_heads,
        head_dim]``. Scores are ``q . k * scale``.
        """

    def reads_block_table(self, metadata: AttentionMetadata) -> bool:
        """Whether attending through ``metadata``'s attached manager reads
        ``metadata.kv_cache_block_offsets`` (a CUDA graph replay must copy it in beforehand)."""
        del metadata
        return True

    def paged_metadata(self, metadata: AttentionMetadata | None) -> AttentionMetadata:
        """``metadata``, which a paged backend cannot do without (a clear error if it is None)."""
        if metadata is None:
            raise ValueError(
                f"attn_backend={self.name!r} attends through the paged KV cache and needs "
                "attn_metadata; a full-sequence forward without a cache runs under "
                "tensorrt_llm._torch.training.use_training_backend(model)"
            )
        return metadata
