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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import MsaConfig
    from tensorrt_llm._torch.attention_backend.trtllm import TrtllmAttentionMetadata


class PagedKVCache(Protocol):
    tokens_per_block: int
    max_blocks_per_seq: int
    num_pools: int

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


@dataclass(frozen=True)
class MsaInputs:
    """What MSA's light indexer computed for the step's tokens (``...`` is the token dims of ``q``).

    index_q: ``[..., index_n_heads, index_head_dim]``; index_w: ``[..., index_n_heads]`` (per-head
    weights, already divided by ``sqrt(index_n_heads)``); index_k: ``[..., 1, index_head_dim]`` (the
    one shared index-K head, cached per token like K).
    """

    index_q: torch.Tensor
    index_w: torch.Tensor
    index_k: torch.Tensor


class AttentionBackend(ABC):
    """How a model's attention layers attend: the one seam between a model and its attention ops.

    A model holds one backend (``attn_backend``) and calls it from every attention layer; it never
    imports an attention op. Implementations differ in where the keys come from:

    - paged backends (``VANILLA``, later ``TRITON``): ``q, k, v`` are the step's flattened tokens
      ``[num_tokens, heads, head_dim]``; the call first writes the step's K and V (and index-K) at
      the step's positions through ``metadata.kv_cache_manager`` (``PagedKVCache`` above), then
      attends each query to every cached key of its sequence at a position ``<=`` its own;
    - the training backend (``tensorrt_llm._torch.training``): whole sequences ``[B, T, heads,
      head_dim]`` from position 0, no cache, ``metadata`` is ``None``.

    Both return ``[..., num_heads, head_dim]`` shaped like ``q`` (``num_heads`` a multiple of
    ``num_kv_heads``: GQA). A backend may keep state between calls (the training backend collects
    the indexer loss); it must not change a model's parameters.
    """

    name: ClassVar[str]

    @abstractmethod
    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: TrtllmAttentionMetadata | None,
        scale: float,
    ) -> torch.Tensor:
        """Dense causal attention of layer ``layer_idx``.

        q: ``[..., num_heads, head_dim]``; k, v: ``[..., num_kv_heads, head_dim]`` -> ``[..., num_heads,
        head_dim]``. Scores are ``q . k * scale``.
        """

    @abstractmethod
    def msa_attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        msa: MsaInputs,
        metadata: TrtllmAttentionMetadata | None,
        cfg: MsaConfig,
        scale: float,
    ) -> torch.Tensor:
        """MiniMax sparse attention of layer ``layer_idx`` (``sparse/minimax_m3/msa.py``): each query
        attends the key blocks its indexer scores select under ``cfg``. Shapes as ``attention``; a
        paged backend also caches ``msa.index_k``."""
