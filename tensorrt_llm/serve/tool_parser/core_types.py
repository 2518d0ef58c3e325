"""What a tool parser returns: the text that is not a tool call, and the calls (or, streamed,
the new part of each)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCallItem:
    """A call, or a streamed piece of one: ``tool_index`` counts the reply's calls from 0; the
    first piece of a call has its ``name`` (and ``parameters`` empty), the later ones ``name``
    None and the next part of the arguments' JSON text. Whole, ``parameters`` is that JSON."""

    tool_index: int
    name: str | None
    parameters: str


@dataclass
class StreamingParseResult:
    normal_text: str = ""
    calls: list[ToolCallItem] = field(default_factory=list)
