"""How MiniMax-M3's sparse layers attend: the family's own backend, beside the model's ``attn_backend``.

The generic ``AttentionBackend`` (``attention_backend/backend.py``) knows dense causal attention
only. A sparse layer asks ``msa_backend_for(model.attn_backend)`` for the MSA backend that goes
with it, chosen by the attention backend's name, so the user still picks one ``attn_backend`` and
training still swaps one object:

    VANILLA    the torch reference (``msa.py``): the CPU path and the oracle
    TRITON     the Triton kernels (``triton_msa.py``), K and V written like the dense layers'
    TRAINING   whole sequences without a cache (``tensorrt_llm._torch.training.msa_dense``)

Each ``attend`` writes the step's K, V and index-K through the manager attached to the metadata
(paged backends) and returns ``[..., num_heads, head_dim]`` shaped like ``q``.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (
    MsaConfig,
    MsaInputs,
    msa_paged_attention,
)


class MsaBackend(ABC):
    """MSA of one sparse layer (``msa.py`` states the rule)."""

    def __init__(self, attn_backend: AttentionBackend) -> None:
        self.attn_backend = attn_backend  # the dense backend this one goes with

    @abstractmethod
    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        msa: MsaInputs,
        metadata: AttentionMetadata | None,
        cfg: MsaConfig,
        scale: float,
    ) -> torch.Tensor:
        """q ``[..., H, D]``, k and v ``[..., Hkv, D]``, ``msa`` over the same tokens (one index
        head per KV head) -> ``[..., H, D]``."""


class VanillaMsaBackend(MsaBackend):
    def attend(self, layer_idx, q, k, v, msa, metadata, cfg, scale):
        metadata = self.attn_backend.paged_metadata(metadata)
        return msa_paged_attention(layer_idx, q, k, v, msa, metadata, cfg, scale)


class TritonMsaBackend(MsaBackend):
    """K, V and index-K written by the dense Triton write kernel (the same addressing as the
    backend's dense layers; index-K as a K lane of its own pages), then ``triton_msa_attend``."""

    def attend(self, layer_idx, q, k, v, msa, metadata, cfg, scale):
        from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.triton_msa import (
            triton_msa_attend,
            write_index_k_pages,
        )
        from tensorrt_llm._torch.attention_backend.triton.ops import write_kv_pages

        backend = self.attn_backend
        metadata = backend.paged_metadata(metadata)
        kv = backend.paged_kv(metadata, layer_idx)
        write_kv_pages(k, v, kv, metadata.position_ids, metadata.token_seq_idx)
        write_index_k_pages(layer_idx, msa.index_k, metadata)
        return triton_msa_attend(layer_idx, q, msa, metadata, cfg, scale)


# attn_backend name -> the MSA backend that goes with it; the training package adds "TRAINING"
# (``tensorrt_llm._torch.training.msa_dense``), so inference never imports training code.
MSA_BACKENDS: dict[str, Callable[[AttentionBackend], MsaBackend]] = {
    "VANILLA": VanillaMsaBackend,
    "TRITON": TritonMsaBackend,
}

_made: weakref.WeakKeyDictionary[AttentionBackend, MsaBackend] = weakref.WeakKeyDictionary()


def msa_backend_for(attn_backend: AttentionBackend) -> MsaBackend:
    """The MSA backend of ``attn_backend`` (one per backend instance, made on first use)."""
    msa = _made.get(attn_backend)
    if msa is None:
        factory = MSA_BACKENDS.get(attn_backend.name)
        if factory is None:
            raise ValueError(
                f"attn_backend={attn_backend.name!r} has no MiniMax-M3 sparse attention; "
                f"known: {sorted(MSA_BACKENDS)}"
            )
        msa = _made[attn_backend] = factory(attn_backend)
    return msa
