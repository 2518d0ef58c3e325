"""MiniMax-M3's tool parser (``minimax_m3_markup.py`` reads the markup).

What a reply reads to, whole (``detect_and_parse``) or streamed however its pieces cut it:

- text outside a block is normal text;
- a call is an ``invoke`` that closes and whose arguments read; it stands whatever follows it;
- where the markup stops reading (text or a stray tag between invokes, a closing tag that closes
  nothing open, an invoke never closed, a block with no call, arguments that do not read), the
  text from the first thing that did not make a call (the block's opening tag, when the block made
  none) to that point is normal text, and reading goes on from there as normal text, where a new
  block may open. A marker that opens or closes nothing thus stays in the text.

Streamed, a call goes out whole, its name then its arguments' JSON, once its invoke closes: a call
announced earlier could still fail to close (a reply cut by ``max_tokens``, a fault further on),
and the whole reply's reading would not have it. The calls of a block go out one by one as each
closes. Normal text goes out at once, save what may begin a block's opening tag, and a block's
text until it is decided. Every decision streamed is one the whole reply's reading makes: the
pieces joined are ``detect_and_parse``'s result, wherever the pieces are cut.
"""

from __future__ import annotations

import json

from tensorrt_llm.llmapi.reasoning_parser import held_back
from tensorrt_llm.serve.tool_parser.base_tool_parser import BaseToolParser
from tensorrt_llm.serve.tool_parser.core_types import StreamingParseResult, ToolCallItem
from tensorrt_llm.serve.tool_parser.minimax_m3_markup import (
    BLOCK_CLOSE,
    BLOCK_OPEN,
    Malformed,
    arguments,
    read_block,
)


def tool_schemas(tools: list) -> dict[str, dict | None]:
    """Each tool's name -> its ``parameters`` schema (``ChatCompletionToolsParam`` or dicts)."""
    out = {}
    for tool in tools or ():
        function = tool["function"] if isinstance(tool, dict) else tool.function
        if isinstance(function, dict):
            out[function.get("name")] = function.get("parameters")
        else:
            out[function.name] = function.parameters
    return out


class MiniMaxM3ToolParser(BaseToolParser):
    def __init__(self) -> None:
        # the text not decided yet: normal text held back, or a block's, from its opening tag
        # (no call of it given out yet) or from the end of its last call given out
        self._buffer = ""
        self._in_block = False
        self._num_calls = 0  # the reply's calls given out
        self._block_calls = 0  # of them, the block's being read

    def has_tool_call(self, text: str) -> bool:
        return BLOCK_OPEN in text

    def detect_and_parse(self, text: str, tools: list) -> StreamingParseResult:
        parser = MiniMaxM3ToolParser()
        parser._buffer = text
        read = parser._advance(tool_schemas(tools), final=True)  # (one read of the whole)
        out = StreamingParseResult(read.normal_text)
        for item in read.calls:
            if item.name is not None:
                out.calls.append(ToolCallItem(item.tool_index, item.name, ""))
            out.calls[-1].parameters += item.parameters  # (a call's pieces come in order)
        return out

    def parse_streaming_increment(self, new_text: str, tools: list) -> StreamingParseResult:
        self._buffer += new_text
        return self._advance(tool_schemas(tools), final=False)

    def finish(self, tools: list) -> StreamingParseResult:
        return self._advance(tool_schemas(tools), final=True)

    def _advance(self, schemas: dict, final: bool) -> StreamingParseResult:
        out = StreamingParseResult()
        while True:
            if not self._in_block:
                at = self._buffer.find(BLOCK_OPEN)
                if at < 0:
                    keep = 0 if final else held_back(self._buffer, (BLOCK_OPEN,))
                    out.normal_text += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.normal_text += self._buffer[:at]
                self._buffer = self._buffer[at:]
                self._in_block, self._block_calls = True, 0
            if not self._read_block(schemas, final, out):
                return out

    def _read_block(self, schemas: dict, final: bool, out: StreamingParseResult) -> bool:
        """Gives out the calls of the block that are decided; True when the block is done with
        (the buffer then holds what follows it), False while it waits for more text."""
        skip = 0 if self._block_calls else len(BLOCK_OPEN)  # (the body: after the opening tag)
        body = self._buffer[skip:]
        read = read_block(body, final)
        fault, given = read.fault, 0  # (given: the body's text up to the last call given out)
        pending = None  # the first invoke that made no call
        for invoke in read.invokes:
            if not invoke.end and not final:
                pending = invoke  # (its closing tag has not arrived)
                break
            try:
                if not invoke.end:
                    raise Malformed(len(body))  # (never closed)
                args = arguments(invoke.params, schemas.get(invoke.name))
            except Malformed as bad:
                pending, fault = invoke, min(bad.at, len(body) if fault is None else fault)
                break
            self._give_call(invoke.name, args, out)
            given = invoke.end
        if fault is None and read.end is not None and not self._block_calls:
            fault = read.end - len(BLOCK_CLOSE)  # (a block of no call)
        if fault is None and final and read.end is None and not self._block_calls:
            fault = len(body)  # (a block opened at the end, no call in it)
        if fault is not None:
            start = skip + min(fault, pending.start if pending else fault)
            out.normal_text += self._buffer[start if self._block_calls else 0 : skip + fault]
            self._buffer, self._in_block = self._buffer[skip + fault :], False
            return True
        if read.end is not None or final:  # (at the end, whitespace after its last call)
            self._buffer = self._buffer[skip + (read.end or len(body)) :]
            self._in_block = False
            return True
        self._buffer = self._buffer[skip + given :] if given else self._buffer
        return False

    def _give_call(self, name: str, args: dict, out: StreamingParseResult) -> None:
        index = self._num_calls
        out.calls.append(ToolCallItem(index, name, ""))
        out.calls.append(ToolCallItem(index, None, json.dumps(args, ensure_ascii=False)))
        self._num_calls += 1
        self._block_calls += 1
