"""A chat reply's text read by the server's parsers: its reasoning first
(``--reasoning_parser``: ``reasoning_content``), then, in what is left, its tool calls
(``--tool_parser``: ``tool_calls``, the finish reason ``tool_calls``). Whole for a reply, or step
by step for a stream (``ReplyParsing.stream``), in OpenAI's shapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tensorrt_llm.llmapi.reasoning_parser import BaseReasoningParser
from tensorrt_llm.serve.openai_protocol import new_id
from tensorrt_llm.serve.tool_parser import BaseToolParser, ToolCallItem


def _finish_reason(reason, called: bool):
    """``tool_calls`` for a reply that called a tool and stopped of itself."""
    return "tool_calls" if called and getattr(reason, "value", reason) == "stop" else reason


@dataclass
class ReplyParsing:
    """``reasoning``: a parser whose fresh copies read each choice; ``tool_parser``: makes one
    per choice; ``tools``: the request's (their schemas type the arguments)."""

    reasoning: BaseReasoningParser | None = None
    tool_parser: Callable[[], BaseToolParser] | None = None
    tools: list = field(default_factory=list)

    def whole(self, text: str, finish_reason) -> tuple[dict, object]:
        """A finished reply's message and finish reason."""
        message: dict = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            split = self.reasoning.parse(text)
            message["content"] = split.content
            message["reasoning_content"] = split.reasoning_content or None
        if self.tool_parser is None:
            return message, finish_reason
        found = self.tool_parser().detect_and_parse(message["content"], self.tools)
        message["content"] = found.normal_text or (None if found.calls else "")
        if found.calls:
            message["tool_calls"] = [
                {
                    "id": new_id("call"),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.parameters},
                }
                for call in found.calls
            ]
        return message, _finish_reason(finish_reason, bool(found.calls))

    def stream(self) -> StreamSplit:
        return StreamSplit(self)


class StreamSplit:
    """One streamed choice's parsers: each step's new text in, its delta's parts out."""

    def __init__(self, parsing: ReplyParsing) -> None:
        self.tools = parsing.tools
        self.reasoning = None if parsing.reasoning is None else parsing.reasoning.fresh()
        self.tool_parser = None if parsing.tool_parser is None else parsing.tool_parser()
        self.called = False

    def step(self, text: str, finished: bool) -> dict:
        """The delta's ``reasoning_content``, ``content`` and ``tool_calls`` that ``text``
        (the step's new text) completes; empty ones left out."""
        reasoning = ""
        if self.reasoning is not None:
            split = self.reasoning.parse_delta(text)
            if finished:
                rest = self.reasoning.finish()
                split.content += rest.content
                split.reasoning_content += rest.reasoning_content
            text, reasoning = split.content, split.reasoning_content
        calls: list[ToolCallItem] = []
        if self.tool_parser is not None:
            found = self.tool_parser.parse_streaming_increment(text, self.tools)
            text, calls = found.normal_text, found.calls
            if finished:
                rest = self.tool_parser.finish(self.tools)
                text, calls = text + rest.normal_text, calls + rest.calls
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if calls:
            self.called = True
            delta["tool_calls"] = _call_deltas(calls)
        return delta

    def finish_reason(self, reason):
        return _finish_reason(reason, self.called)


def _call_deltas(items: list[ToolCallItem]) -> list[dict]:
    """Tool call pieces as OpenAI's stream deltas: one entry per call, its first with the id,
    type and name."""
    entries: dict[int, dict] = {}
    for item in items:
        entry = entries.get(item.tool_index)
        if entry is None:
            entry = entries[item.tool_index] = {"index": item.tool_index}
            if item.name is not None:
                entry |= {"id": new_id("call"), "type": "function"}
                entry["function"] = {"name": item.name, "arguments": ""}
            else:
                entry["function"] = {"arguments": ""}
        entry["function"]["arguments"] += item.parameters
    return list(entries.values())
