"""The commands rank 0 sends the other ranks at the start of a step, as typed dataclasses.

They cross the control group as JSON (``to_json`` / ``from_json``: a ``kind`` and the fields);
nothing is pickled. ``rank`` names the rank a command is for; ``EVERY_RANK`` (-1) all of them
(tensor parallelism, and releases); under attention DP a request's commands name its rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

EVERY_RANK = -1


@dataclass(frozen=True)
class SubmitCommand:
    """Start a request (``ranks.request_to_json``) at its prompt."""

    kind: ClassVar[str] = "submit"
    rank: int
    request: dict


@dataclass(frozen=True)
class GenerationOnlyCommand:
    """Start a request resumed from a context server: its first token and drafts, and the handle
    to the prompt's KV (``TransferHandle`` as JSON), which every rank pulls its heads of."""

    kind: ClassVar[str] = "generation_only"
    rank: int
    request: dict
    output_token_ids: list[int]
    draft_tokens: list[int]
    handle: dict


@dataclass(frozen=True)
class CancelCommand:
    kind: ClassVar[str] = "cancel"
    rank: int
    request_id: int


@dataclass(frozen=True)
class ReleaseCommand:
    """Free held context-only KV: rank 0 saw it pulled, or its hold time out."""

    kind: ClassVar[str] = "release"
    request_ids: list[int]
    rank: int = EVERY_RANK


@dataclass(frozen=True)
class ShutdownCommand:
    """The other ranks leave their loops."""

    kind: ClassVar[str] = "shutdown"
    rank: int = EVERY_RANK


RankCommand = (
    SubmitCommand | GenerationOnlyCommand | CancelCommand | ReleaseCommand | ShutdownCommand
)
_KINDS: dict[str, type] = {
    c.kind: c
    for c in (SubmitCommand, GenerationOnlyCommand, CancelCommand, ReleaseCommand, ShutdownCommand)
}


def to_json(command: RankCommand) -> dict:
    return {"kind": command.kind, **dataclasses.asdict(command)}


def from_json(data: dict) -> RankCommand:
    """A command from its JSON; ``ValueError`` naming an unknown kind or a wrong field."""
    fields = dict(data)
    kind = fields.pop("kind", None)
    if kind not in _KINDS:
        raise ValueError(f"rank command of kind {kind!r}; known: {sorted(_KINDS)}")
    try:
        return _KINDS[kind](**fields)
    except TypeError as exc:
        raise ValueError(f"rank command {kind!r}: {exc}") from None


def is_for(command: RankCommand, rank: int) -> bool:
    return command.rank in (EVERY_RANK, rank)
