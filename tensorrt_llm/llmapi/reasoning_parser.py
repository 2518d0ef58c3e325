"""Reasoning parsers: a model's output split into its reasoning and its answer.

A parser reads the generated text whole (``parse``) or as it streams (``parse_delta`` per new
piece of text, then ``finish`` once at the end) and returns ``ReasoningParserResult(content,
reasoning_content)``: for a stream, the new part of each. The pieces may cut a marker anywhere
(a marker spread over several tokens): a parser holds back text that could still turn into one,
so concatenated, a stream's results equal ``parse`` of the whole text, and no marker ever reaches
either field.

``ReasoningParserFactory.create_reasoning_parser(name, chat_template_kwargs)`` makes one per
request: what the chat template put after the generation prompt (a thinking mode) decides where
the output starts.

MiniMax-M3 (``minimax_m3``) reasons in ``<mm:think>reasoning</mm:think>content``. Its template's
``thinking_mode``:

- ``enabled``: the prompt ends with ``<mm:think>``, so the output starts inside the reasoning (a
  ``<mm:think>`` the model writes again there is dropped);
- ``disabled``: the prompt ends with ``</mm:think>``, so the output is the answer;
- ``adaptive`` (the default): the model opens a block itself, writes a bare ``</mm:think>`` (no
  reasoning: dropped), or answers at once.

A block the model opens at the start is reasoning in every mode (whitespace before it allowed).
Reasoning never closed (the token limit came first) stays reasoning. A marker anywhere else is
dropped and the text around it kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

THINKING_MODES = ("enabled", "disabled", "adaptive")


@dataclass
class ReasoningParserResult:
    content: str = ""
    reasoning_content: str = ""


class BaseReasoningParser(ABC):
    """One request's parser. ``parse_delta`` and ``finish`` keep state between calls (one stream);
    ``parse`` does not touch it."""

    @abstractmethod
    def parse_delta(self, delta_text: str) -> ReasoningParserResult:
        """The content and reasoning ``delta_text`` completes (text that may still be part of a
        marker is held until the next piece or ``finish``)."""

    @abstractmethod
    def finish(self) -> ReasoningParserResult:
        """What was held back, at the end of the output."""

    @abstractmethod
    def fresh(self) -> BaseReasoningParser:
        """A parser of the same request, at the start of its output."""

    def parse(self, text: str) -> ReasoningParserResult:
        """The whole output's content and reasoning."""
        parser = self.fresh()
        first, last = parser.parse_delta(text), parser.finish()
        return ReasoningParserResult(
            first.content + last.content, first.reasoning_content + last.reasoning_content
        )


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers``."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in markers):
            return size
    return 0


class ThinkBlockParser(BaseReasoningParser):
    """``start reasoning end content`` with the markers ``start`` and ``end``; ``thinking_mode``
    as the module says."""

    START: ClassVar[str]
    END: ClassVar[str]
    _OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"

    def __init__(self, thinking_mode: str = "adaptive") -> None:
        if thinking_mode not in THINKING_MODES:
            raise ValueError(
                f"thinking_mode={thinking_mode!r}: expected one of {list(THINKING_MODES)}"
            )
        self.thinking_mode = thinking_mode
        self._state = self._REASONING if thinking_mode == "enabled" else self._OPENING
        self._at_start = True  # nothing classified yet: an opening marker may still come
        self._pending = ""

    def fresh(self) -> ThinkBlockParser:
        return type(self)(self.thinking_mode)

    @classmethod
    def mode_of_prompt(cls, prompt: str) -> str:
        """The thinking mode a rendered prompt shows: it opened the block (``enabled``), closed
        it (``disabled``), or left it to the model."""
        end = prompt.rstrip()
        if end.endswith(cls.START):
            return "enabled"
        return "disabled" if end.endswith(cls.END) else "adaptive"

    def parse_delta(self, delta_text: str) -> ReasoningParserResult:
        self._pending += delta_text
        return self._advance(final=False)

    def finish(self) -> ReasoningParserResult:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningParserResult:
        out = ReasoningParserResult()
        while True:
            if self._at_start:
                if not self._opening(final):
                    return out  # (it may still be a marker)
                continue
            text, markers = self._pending, (self.START, self.END)
            field = "reasoning_content" if self._state == self._REASONING else "content"
            found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
            if found:  # the reasoning's end; any other marker is dropped, the text around kept
                at, marker = min(found)
                setattr(out, field, getattr(out, field) + text[:at])
                self._pending = text[at + len(marker) :]
                if marker == self.END and self._state == self._REASONING:
                    self._state = self._CONTENT
                continue
            keep = 0 if final else held_back(text, markers)
            setattr(out, field, getattr(out, field) + text[: len(text) - keep])
            self._pending = text[len(text) - keep :]
            return out

    def _opening(self, final: bool) -> bool:
        """At the start of the output: take an opening marker (or, before an answer, a bare end
        marker) after any whitespace. False while the text may still become one."""
        head = self._pending.lstrip()
        markers = (self.START,) if self._state == self._REASONING else (self.START, self.END)
        for marker in markers:
            if head.startswith(marker):
                self._pending = head[len(marker) :]
                self._state = self._CONTENT if marker == self.END else self._REASONING
                self._at_start = False
                return True
        if not final and any(marker.startswith(head) for marker in markers):
            return False  # (whitespace only, or a marker's beginning)
        if self._state == self._OPENING:
            self._state = self._CONTENT  # an answer at once
        self._at_start = False
        return True


class MiniMaxM3ReasoningParser(ThinkBlockParser):
    START = "<mm:think>"
    END = "</mm:think>"


class ReasoningParserFactory:
    parsers: ClassVar[dict[str, type[ThinkBlockParser]]] = {
        "minimax_m3": MiniMaxM3ReasoningParser,
    }

    @classmethod
    def create_reasoning_parser(
        cls, name: str, chat_template_kwargs: dict | None = None, prompt: str | None = None
    ) -> BaseReasoningParser:
        """The parser ``name`` for a request rendered with ``chat_template_kwargs`` (its
        ``thinking_mode``, ``adaptive`` when absent). With the rendered ``prompt`` (its end is
        enough), where the reply starts is read from it instead: a template that ignores
        ``thinking_mode`` opens no block, whatever the request asked."""
        parser = cls.parsers.get(name)
        if parser is None:
            raise ValueError(f"reasoning parser {name!r}: expected one of {sorted(cls.parsers)}")
        if prompt is not None:
            return parser(parser.mode_of_prompt(prompt))
        mode = (chat_template_kwargs or {}).get("thinking_mode", "adaptive")
        return parser(mode)
