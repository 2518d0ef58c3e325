"""What a decoding step hands back to the executor, with or without speculation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class StepTokens:
    """Per request of the batch, in batch order: the tokens the step made final (empty for a context
    chunk that does not finish its prompt), the drafts to verify next step, and how many of the
    previous drafts were accepted (None when the request verified nothing)."""

    new_tokens: list[list[int]]
    next_drafts: list[list[int]]
    num_accepted: list[int | None]


class DraftGuide(Protocol):
    """The grammars' masks of a step's draft chain, from the host (``pyexecutor/draft_guide.py``):
    ``begin`` with the step's tokens, ``mask`` before each draft, ``end``."""

    def begin(self, tokens: torch.Tensor, accepted: torch.Tensor) -> None: ...

    def mask(self, drafted: torch.Tensor | None) -> torch.Tensor | None: ...

    def end(self) -> None: ...


DRAFT_KV_CACHE_MODES = ("unified", "separate")


@dataclass(frozen=True)
class Eagle3SpecConfig:
    """One-model Eagle3 as the runtime sees it (``Eagle3DecodingConfig`` translated).

    ``draft_kv_cache``: ``"unified"`` keeps the drafter's KV in the target's slots (read through the
    sub-page view); ``"separate"`` gives it a second manager that mirrors requests, never reuses and
    is not transferred (kept to measure what the unified cache buys).
    """

    max_draft_len: int
    speculative_model: str
    num_eagle_layers: int = 1
    eagle3_layers_to_capture: tuple[int, ...] | None = None
    draft_kv_cache: str = "unified"

    def __post_init__(self) -> None:
        if self.max_draft_len < 1 or self.num_eagle_layers < 1:
            raise ValueError(
                f"max_draft_len={self.max_draft_len} and num_eagle_layers={self.num_eagle_layers} "
                "must be >= 1"
            )
        if self.draft_kv_cache not in DRAFT_KV_CACHE_MODES:
            raise ValueError(
                f"draft_kv_cache={self.draft_kv_cache!r}: expected one of {DRAFT_KV_CACHE_MODES}"
            )

    @property
    def num_draft_layers(self) -> int:
        """Draft layers appended to the target's KV cache."""
        return self.num_eagle_layers


@dataclass(frozen=True)
class RelaxedAcceptance:
    """Relaxed acceptance in the thinking phase (``speculative/relaxed.py``): a greedy row inside
    a reasoning block accepts a draft among the target's ``topk`` most likely tokens within
    ``delta`` of the top one's probability. ``begin`` / ``end``: the block's marker ids (None:
    the tokenizer's ``<mm:think>`` / ``</mm:think>``, found at engine creation)."""

    topk: int = 1
    delta: float = 0.0
    begin: int | None = None
    end: int | None = None


@dataclass(frozen=True)
class MTPSpecConfig:
    """MiniMax-M3's own MTP module as the one-model drafter (``MTPDecodingConfig`` translated).

    The module's weights are the target checkpoint's ``mtp.*`` (or ``speculative_model``'s, a
    standalone MTP checkpoint); one module is replayed for every draft step. ``draft_kv_cache``:
    ``"unified"`` keeps its layer in the target's slots as one more sparse layer, whole pages;
    ``"separate"`` gives it a second manager (kept to measure what the unified cache buys).
    """

    max_draft_len: int
    num_nextn_predict_layers: int = 1
    speculative_model: str | None = None
    draft_kv_cache: str = "unified"
    relaxed: RelaxedAcceptance | None = None

    def __post_init__(self) -> None:
        if self.max_draft_len < 1:
            raise ValueError(f"max_draft_len={self.max_draft_len} must be >= 1")
        if self.num_nextn_predict_layers != 1:
            raise ValueError(
                f"num_nextn_predict_layers={self.num_nextn_predict_layers}: MiniMax-M3 has one MTP "
                "module, replayed for every draft step (1)"
            )
        if self.draft_kv_cache not in DRAFT_KV_CACHE_MODES:
            raise ValueError(
                f"draft_kv_cache={self.draft_kv_cache!r}: expected one of {DRAFT_KV_CACHE_MODES}"
            )

    @property
    def num_draft_layers(self) -> int:
        """Draft layers appended to the target's KV cache: the module's one sparse layer."""
        return self.num_nextn_predict_layers
