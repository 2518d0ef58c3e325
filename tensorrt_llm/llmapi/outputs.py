"""What ``LLM`` hands back: ``RequestOutput`` per request, and the output side that makes it.

The executor produces tokens; the output side turns them into text, incrementally (each step
decodes only a short window of tokens, not the whole output), and finds the stop strings there.
A request whose text reaches a stop string is ended through the executor's ``finish_request``
(between steps, on the engine loop's thread), and its output stops at the token that completed
the string; the text at the string's start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes of a character not yet complete


class SoFar:
    """The first ``n`` items of a list that only grows (a request's output tokens, its
    logprobs): a snapshot taken without copying, read as a list of its own when asked."""

    __slots__ = ("items", "n")

    def __init__(self, items: list, n: int) -> None:
        self.items, self.n = items, n

    def __len__(self) -> int:
        return self.n

    def copy(self) -> list:
        return self.items[: self.n]


def _read(held: list | SoFar | None) -> list | None:
    """``held`` as a list of its own (a ``SoFar`` copied)."""
    return held.copy() if isinstance(held, SoFar) else held


def _tail(held: list | SoFar, start: int) -> list:
    """``held[start:]``, copying only those items."""
    return held.items[start : held.n] if isinstance(held, SoFar) else held[start:]


class CompletionOutput:
    """One choice's output so far. ``token_ids`` and ``logprobs`` (per token: its log-probability
    and ``[(token, lp), ...]``, with ``SamplingParams.logprobs``) may be given as ``SoFar``: the
    engine's outputs are, so a step's output copies none of a request's tokens until they are
    read (a stream that reads the text and ``num_tokens`` copies nothing; a copy per step would
    cost a long output's length at every step)."""

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int] | SoFar,
        finish_reason: FinishReason | None = None,
        stop_reason: int | str | None = None,
        avg_decoded_tokens_per_iter: float | None = None,
        generation_logits: torch.Tensor | None = None,  # [num_tokens, vocab] if requested
        logprobs: list[tuple[float, list[tuple[int, float]]]] | SoFar | None = None,
    ) -> None:
        self.index, self.text = index, text
        self._token_ids, self._logprobs = token_ids, logprobs
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self.avg_decoded_tokens_per_iter = avg_decoded_tokens_per_iter
        self.generation_logits = generation_logits

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_visible(self) -> int:
        """The tokens the text shows (an end token that stopped the request is not shown)."""
        hidden = self.finish_reason is FinishReason.STOP and isinstance(self.stop_reason, int)
        return self.num_tokens - hidden

    def tokens_from(self, start: int) -> list[int]:
        """``token_ids[start:]``, copying only those."""
        return _tail(self._token_ids, start)

    def logprobs_from(self, start: int) -> list:
        """``logprobs[start:]``, copying only those."""
        return _tail(self._logprobs, start)

    @property
    def token_ids(self) -> list[int]:
        self._token_ids = _read(self._token_ids)
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        self._logprobs = _read(self._logprobs)
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value) -> None:
        self._logprobs = value

    def _fields(self) -> tuple:
        return (
            self.index,
            self.text,
            self.token_ids,
            self.finish_reason,
            self.stop_reason,
            self.avg_decoded_tokens_per_iter,
            self.generation_logits,
            self.logprobs,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return self._fields() == other._fields()

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason!r}, "
            f"avg_decoded_tokens_per_iter={self.avg_decoded_tokens_per_iter})"
        )


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # a context-only request's reply, once it finished (the handle to its held KV)
    disaggregated_params: DisaggregatedParams | None = None
    received_at: float | None = None  # time.monotonic() when the engine core received it
    admitted_at: float | None = None  # time.monotonic() when the scheduler granted its KV


class IncrementalDetokenizer:
    """Text of a growing token list, decoding a window per token: the tokens from
    ``prefix_offset`` on, against those up to ``read_offset`` (what was already shown), so a
    character split over tokens is shown once whole and a tokenizer's spacing rules see context."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""
        self.prefix_offset = self.read_offset = 0

    def add(self, token: int) -> str:
        """Append ``token``; returns the text it completes (maybe empty)."""
        self.tokens.append(token)
        shown = self.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(shown) or full.endswith(REPLACEMENT):
            return ""
        delta = full[len(shown) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta


class OutputTracker:
    """One request's output side: its text so far and the stop strings in it."""

    def __init__(
        self,
        request: LlmRequest,
        prompt: str | None,
        decode: Callable[[list[int]], str] | None,
    ) -> None:
        self.request, self.prompt = request, prompt
        params = request.sampling_params
        self.detokenizer = IncrementalDetokenizer(decode) if params.detokenize else None
        self.stops = list(params.stop or []) if self.detokenizer is not None else []
        self.num_tokens = 0  # output tokens seen (after a stop string: those kept)
        self.text_limit: int | None = None  # where the stop string starts in the text
        self.stop_hit: str | None = None

    def consume(self) -> str | None:
        """Read the request's new tokens; returns the stop string they completed, if any (the
        output then ends at the token that completed it)."""
        tokens = self.request.output_token_ids
        while self.num_tokens < len(tokens) and self.stop_hit is None:
            token = tokens[self.num_tokens]
            self.num_tokens += 1
            if self.detokenizer is None or self._is_end_token(token):
                continue
            delta = self.detokenizer.add(token)
            if delta and self.stops:
                self._find_stop(len(delta))
        return self.stop_hit

    def _is_end_token(self, token: int) -> bool:
        """An end token that stopped the request is not text."""
        request = self.request
        return (
            request.finish_reason is FinishReason.STOP
            and request.stop_reason == token
            and self.num_tokens == len(request.output_token_ids)
        )

    def _find_stop(self, num_new_chars: int) -> None:
        text = self.detokenizer.text
        longest = max(len(s) for s in self.stops)
        start = max(0, len(text) - num_new_chars - longest + 1)  # a string may span the delta
        hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
        if hits:
            self.text_limit, self.stop_hit = min(hits)

    def output(
        self, finished: bool, disaggregated_params: DisaggregatedParams | None = None
    ) -> RequestOutput:
        request, n = self.request, self.num_tokens
        text = ""
        if self.detokenizer is not None:
            text = self.detokenizer.text
            if finished and self.stop_hit is None:  # whole, once: the tokenizer's own decode
                tokens = request.output_token_ids[:n]
                text = self.detokenizer.decode(
                    visible_tokens(tokens, request.finish_reason, request.stop_reason)
                )
            if self.text_limit is not None:
                text = text[: self.text_limit]
        params = request.sampling_params
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=SoFar(request.output_token_ids, n),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            avg_decoded_tokens_per_iter=request.avg_decoded_tokens_per_iter,
            generation_logits=torch.stack(request.py_generation_logits[:n])
            if request.py_generation_logits
            else None,
            logprobs=SoFar(request.py_logprobs, n) if params.logprobs is not None else None,
        )
        return RequestOutput(
            request.request_id,
            self.prompt,
            request.prompt_token_ids,
            [completion],
            finished=finished,
            disaggregated_params=disaggregated_params,
            received_at=request.received_at,
            admitted_at=request.admitted_at,
        )


def visible_tokens(
    token_ids: list[int], finish_reason: FinishReason | None, stop_reason: int | str | None
) -> list[int]:
    """The output tokens the text shows: an end token that stopped the request is not shown."""
    if finish_reason is FinishReason.STOP and isinstance(stop_reason, int):
        return token_ids[:-1]
    return token_ids
