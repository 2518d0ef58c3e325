"""Tool parsers by name (``trtllm-serve --tool_parser``)."""

from __future__ import annotations

from typing import ClassVar

from tensorrt_llm.serve.tool_parser.base_tool_parser import BaseToolParser
from tensorrt_llm.serve.tool_parser.minimax_m3_parser import MiniMaxM3ToolParser


class ToolParserFactory:
    parsers: ClassVar[dict[str, type[BaseToolParser]]] = {"minimax_m3": MiniMaxM3ToolParser}

    @classmethod
    def create_tool_parser(cls, name: str) -> BaseToolParser:
        """A new parser ``name`` (one per reply: a streamed reply's parser keeps state)."""
        parser = cls.parsers.get(name)
        if parser is None:
            raise ValueError(f"tool parser {name!r}: expected one of {sorted(cls.parsers)}")
        return parser()
