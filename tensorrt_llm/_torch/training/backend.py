"""The training attention backend: whole ``[B, T]`` sequences from position 0, no KV cache.

Training code installs it on a model for the span of a ``with`` block::

    with use_training_backend(model, train_indexer=True) as backend:
        hidden, _ = model(input_ids)          # input_ids [B, T]
        loss = ... + backend.indexer_loss

so the model keeps one code path (it calls its backend) and holds no training knobs. The same
full-sequence forward is the oracle the paged path is tested against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata


class TrainingAttentionBackend(AttentionBackend):
    """Causal attention over ``[B, T, heads, head_dim]`` with key ``j`` at position ``j``.

    Knobs of MiniMax-M3's sparse layers, read by their training MSA backend
    (``msa_dense.TrainingMsaBackend``): ``msa_sparse``: attend only the selected blocks (``False``:
    densely, the warm-up); ``train_indexer``: compute the indexer's loss; ``indexer_loss`` sums the
    losses of the last forward.
    """

    name = "TRAINING"

    def __init__(self, msa_sparse: bool = True, train_indexer: bool = False) -> None:
        self.msa_sparse = msa_sparse
        self.train_indexer = train_indexer
        self.indexer_losses: dict[int, torch.Tensor] = {}  # layer_idx -> loss of the last forward

    @property
    def indexer_loss(self) -> torch.Tensor | float:
        """Sum over MSA layers of the last forward's indexer losses (0.0 if none was computed)."""
        return sum(self.indexer_losses.values(), 0.0)

    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata | None,
        scale: float,
    ) -> torch.Tensor:
        check_no_cache(metadata)
        groups = q.shape[2] // k.shape[2]
        return F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, H, T, D]
            k.transpose(1, 2).repeat_interleave(groups, dim=1),
            v.transpose(1, 2).repeat_interleave(groups, dim=1),
            is_causal=True,
            scale=scale,
        ).transpose(1, 2)


def check_no_cache(metadata: AttentionMetadata | None) -> None:
    if metadata is not None:
        raise ValueError(
            "the training attention backend runs whole sequences without a KV cache: "
            "call the model without attn_metadata"
        )


@contextlib.contextmanager
def use_training_backend(
    model: nn.Module, msa_sparse: bool = True, train_indexer: bool = False
) -> Iterator[TrainingAttentionBackend]:
    """Run ``model`` (anything holding an ``attn_backend``) on a new training backend inside the
    block; its previous backend is restored afterwards, even on error."""
    if not isinstance(getattr(model, "attn_backend", None), AttentionBackend):
        raise TypeError(f"{type(model).__name__} holds no attn_backend to replace")
    backend = TrainingAttentionBackend(msa_sparse, train_indexer)
    saved = model.attn_backend
    model.attn_backend = backend
    try:
        yield backend
    finally:
        model.attn_backend = saved
