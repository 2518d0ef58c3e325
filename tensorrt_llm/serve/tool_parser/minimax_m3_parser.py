"""MiniMax-M3's tool parser (``minimax_m3_markup.py`` reads the markup).

Streamed, a call's name goes out once its ``invoke`` tag is read, then its arguments' JSON text
as each argument completes (the object without its closing brace, growing; the brace when the
invoke closes), so that joined they are the whole reply's ``parameters``. An argument goes out
once the next element or the invoke's end shows it is not repeated. Text before a block (and
after it) is normal text; a namespace token or a block opening cut across pieces is held back.
``detect_and_parse`` is the same reading over the whole text at once.

Markup that does not read (a stray tag, text between arguments, an invoke never closed) comes
back as normal text from the first call it touches; calls of the block that closed before it
stand. (Streamed, a call already announced is closed where it stood.)
"""

from __future__ import annotations

import json

from tensorrt_llm.llmapi.reasoning_parser import held_back
from tensorrt_llm.serve.tool_parser.base_tool_parser import BaseToolParser
from tensorrt_llm.serve.tool_parser.core_types import StreamingParseResult, ToolCallItem
from tensorrt_llm.serve.tool_parser.minimax_m3_markup import (
    BLOCK_OPEN,
    BlockRead,
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
        self._buffer = ""  # text not given out yet: normal text held, or the block being read
        self._in_block = False
        self._first_call = 0  # the reply's index of the block's first call
        self._sent: list[str] = []  # per call of the reply: its arguments' JSON text given out
        self._complete: list[bool] = []  # per call: its JSON text given out whole

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
                self._in_block, self._first_call = True, len(self._sent)
            body = self._buffer[len(BLOCK_OPEN) :]
            read = read_block(body, final)
            if final and not read.closed and read.malformed_at is None:
                open_ = [i for i in read.invokes if not i.closed]
                if open_ or not read.invokes:  # (a call never closed, or no call at all)
                    read.malformed_at = open_[0].start if open_ else 0
                else:
                    read.end = len(body)  # (every call closed: the block's end is lenient)
            bad = self._emit(read, schemas, out)
            if bad is not None:
                self._give_back(read, body, out)
                continue
            if not read.closed and not final:
                return out
            self._buffer, self._in_block = body[read.end :], False

    def _emit(self, read: BlockRead, schemas: dict, out: StreamingParseResult) -> int | None:
        """The new pieces of the block's calls; where the markup stops reading, if it does."""
        for index, invoke in enumerate(read.invokes):
            if read.malformed_at is not None and not invoke.closed:
                break  # (the fault is in it: it is not a call)
            call = self._first_call + index
            if call < len(self._complete) and self._complete[call]:
                continue  # (given out whole)
            schema = schemas.get(invoke.name)
            ready = len(invoke.params)
            last = invoke.params[-1].name if invoke.params else None
            if not invoke.closed and (invoke.reading is None or invoke.reading == last):
                while ready and invoke.params[ready - 1].name == last:
                    ready -= 1  # (the last argument's run may go on: a list then)
            try:
                args = arguments(invoke.params[:ready], schema)
            except Malformed as bad:
                return bad.at
            text = json.dumps(args, ensure_ascii=False)
            text = text if invoke.closed else text[:-1]
            if call == len(self._sent):
                self._sent.append("")
                self._complete.append(False)
                out.calls.append(ToolCallItem(call, invoke.name, ""))
            if len(text) > len(self._sent[call]):
                out.calls.append(ToolCallItem(call, None, text[len(self._sent[call]) :]))
                self._sent[call] = text
            self._complete[call] = invoke.closed
        return read.malformed_at

    def _give_back(self, read: BlockRead, body: str, out: StreamingParseResult) -> None:
        """Markup that does not read: the calls closed before it stand; a call announced and
        not closed is closed where it stood; the text from the first call not closed (or the
        block's opening) is normal text, and reading goes on after it as text."""
        first = self._first_call
        closed = 0  # the block's calls given out whole, from its first
        while first + closed < len(self._complete) and self._complete[first + closed]:
            closed += 1
        for call in range(first + closed, len(self._sent)):
            out.calls.append(ToolCallItem(call, None, "}"))
            self._sent[call] += "}"
            self._complete[call] = True
        start = read.invokes[closed].start if closed < len(read.invokes) else None
        text = self._buffer if closed == 0 or start is None else body[start:]
        out.normal_text += text
        self._buffer, self._in_block = "", False
