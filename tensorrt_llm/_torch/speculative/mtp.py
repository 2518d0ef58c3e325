"""MiniMax-M3's MTP module as the one-model drafter.

The Eagle3 worker's step carries over unchanged (``eagle3.py``): accept, a first draft step over
the target step's positions, then a chain of one-token steps. ``MTPDrafter`` gives the module the
drafter's interface: its features are the target's hidden state after the final norm (the model's
capture index ``num_hidden_layers``), its input at position p the token p + 1 (in the first step,
a prompt's next token embedded as the target saw it: ``FirstStep``), its output ``h`` (before the
module's final norm) the next chain step's features, and its logits over the target's whole
vocabulary (the LM head is the target's). Its layer is the target's next layer id: in unified mode
one more sparse layer of the target's slots, attended directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tensorrt_llm._torch.models.modeling_minimaxm3_mtp import mtp_kv_cache_layer
from tensorrt_llm._torch.pyexecutor.model_engine import exchanging_moe


@dataclass
class FirstStep:
    """The first draft step's inputs from the target's forward: its hidden states after the final
    norm, and the step's input embeddings and tokens."""

    hidden: torch.Tensor
    embeddings: torch.Tensor
    input_ids: torch.Tensor

    def next_embeddings(
        self, following: torch.Tensor, positions: torch.Tensor, embedded: torch.Tensor
    ) -> torch.Tensor:
        """The embedding of each row's next token (``following``, embedded as ``embedded``):
        where that token is the step's next input row (a prompt's next position), that row's
        input embedding, so an image's position gets the image's embedding as the target saw it.
        Device-only (graph-safe)."""
        rows = torch.arange(following.shape[0], device=following.device)
        inside = rows + 1 < following.shape[0]
        same = (following == self.input_ids.roll(-1, 0)) & (positions.roll(-1, 0) == positions + 1)
        return torch.where(
            (same & inside)[:, None], self.embeddings.roll(-1, 0).to(embedded.dtype), embedded
        )


class MTPDrafter(nn.Module):
    def __init__(self, target: nn.Module, index: int = 0) -> None:
        """``target``: a model built with its MTP module(s) (``num_mtp_modules``); ``index``:
        the module replayed for every draft step."""
        super().__init__()
        if getattr(target.model, "mtp", None) is None:
            raise ValueError("the target model was built without its MTP module (num_mtp_modules)")
        self.layer = target.model.mtp.layers[index]
        self.index = index
        self.attn_backend = target.attn_backend
        self.draft_vocab_size = target.config.vocab_size
        self._target = (target,)  # (not a submodule: the embedding and LM head are the target's)

    def kv_cache_layer(self, mapping=None):
        """The module's layer as this rank's KV cache keeps it: one more sparse layer."""
        return mtp_kv_cache_layer(self._target[0].config, self.index, mapping)

    def fuse(self, captured: list[torch.Tensor], input_ids: torch.Tensor) -> FirstStep:
        """The first draft step's features: the target's hidden states after its final norm, with
        the step's input embeddings (images merged) and tokens (``captured``: layers -1 and
        ``num_hidden_layers``)."""
        return FirstStep(captured[-1], captured[0], input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor | FirstStep,
        positions: torch.Tensor,
        attn_metadata,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` (token p + 1 at position p) and ``features`` (the first step's, or the
        previous chain step's ``h``) -> the module's ``h`` and its logits ``[n, V]`` (float32),
        of ``rows`` only when given (the KV of every position is written; the MoE and the LM
        head run for those rows alone)."""
        target = self._target[0]
        embeddings = target.model.embed_tokens(input_ids)
        if isinstance(features, FirstStep):
            embeddings = features.next_embeddings(input_ids, positions, embeddings)
            features = features.hidden
        backend = target.attn_backend
        hidden = self.layer(embeddings, features, positions, attn_metadata, backend, rows)
        return hidden, target.mtp_logits(hidden, self.index)

    def exchanging_blocks(self) -> list:
        """The module's MoE if its tokens travel between ranks (EP under attention DP)."""
        return exchanging_moe(self.layer)

    def idle(self, capacity: int | None) -> None:
        """A chain step without rows on this rank: the module's MoE takes part in the exchange."""
        for block in self.exchanging_blocks():
            block.idle(capacity)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def target_probs(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return probs
