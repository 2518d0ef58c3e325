"""Tool-call parsers: a reply's text split into normal text and the tools it calls."""

from tensorrt_llm.serve.tool_parser.base_tool_parser import BaseToolParser
from tensorrt_llm.serve.tool_parser.core_types import StreamingParseResult, ToolCallItem
from tensorrt_llm.serve.tool_parser.minimax_m3_parser import MiniMaxM3ToolParser
from tensorrt_llm.serve.tool_parser.tool_parser_factory import ToolParserFactory

__all__ = [
    "BaseToolParser",
    "MiniMaxM3ToolParser",
    "StreamingParseResult",
    "ToolCallItem",
    "ToolParserFactory",
]
