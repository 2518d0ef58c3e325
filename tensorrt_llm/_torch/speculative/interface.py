"""What a decoding step hands back to the executor, with or without speculation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTokens:
    """Per request of the batch, in batch order: the tokens the step made final (empty for a context
    chunk that does not finish its prompt), the drafts to verify next step, and how many of the
    previous drafts were accepted (None when the request verified nothing)."""

    new_tokens: list[list[int]]
    next_drafts: list[list[int]]
    num_accepted: list[int | None]
