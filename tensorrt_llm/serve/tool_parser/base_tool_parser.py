"""The tool parser's contract: a reply's text split into normal text and tool calls, whole
(``detect_and_parse``) or as it streams (``parse_streaming_increment`` per new piece of text,
``finish`` at the end). Streamed pieces concatenated give the whole result, wherever the text is
cut into pieces: the same normal text, and per call its name and, joined, its arguments' JSON
text."""

from __future__ import annotations

from abc import ABC, abstractmethod

from tensorrt_llm.serve.tool_parser.core_types import StreamingParseResult


class BaseToolParser(ABC):
    """One reply's parser: the streaming calls keep state; ``detect_and_parse`` does not."""

    @abstractmethod
    def has_tool_call(self, text: str) -> bool:
        """Whether ``text`` opens a tool call."""

    @abstractmethod
    def detect_and_parse(self, text: str, tools: list) -> StreamingParseResult:
        """The whole reply's normal text and calls (``tools``: the request's, whose parameter
        schemas type the arguments). Markup that does not parse comes back as normal text."""

    @abstractmethod
    def parse_streaming_increment(self, new_text: str, tools: list) -> StreamingParseResult:
        """What ``new_text`` decides: normal text, and calls (or the parts of one) that the whole
        reply's reading will report whatever follows (text that may still be markup is held
        back)."""

    @abstractmethod
    def finish(self, tools: list) -> StreamingParseResult:
        """What was held back, at the end of the reply."""
