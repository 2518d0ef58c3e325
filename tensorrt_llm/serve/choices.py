"""The choices of a reply: what one request's outputs (``RequestOutput``, one per step) render to,
whole or as stream chunks."""

from __future__ import annotations

from tensorrt_llm.llmapi.outputs import CompletionOutput, RequestOutput, visible_tokens
from tensorrt_llm.llmapi.reasoning_parser import BaseReasoningParser
from tensorrt_llm.serve.logprobs import chat_logprobs, completion_logprobs
from tensorrt_llm.tokenizer import TransformersTokenizer


def visible(out: CompletionOutput) -> list[int]:
    return visible_tokens(out.token_ids, out.finish_reason, out.stop_reason)


class Renderer:
    def __init__(
        self,
        tokenizer: TransformersTokenizer,
        chat: bool,
        reasoning_parser: BaseReasoningParser | None = None,
    ) -> None:
        """``reasoning_parser`` (chat only): the text is split into ``reasoning_content`` and
        ``content`` (each choice parsed by a fresh copy of it)."""
        self.tokenizer, self.chat = tokenizer, chat
        self.reasoning_parser = reasoning_parser if chat else None

    def logprobs(self, out: CompletionOutput, start: int) -> dict:
        """The logprobs of the visible tokens from ``start`` on."""
        tokens = out.tokens_from(start)[: max(0, out.num_visible - start)]
        values = out.logprobs_from(start)[: len(tokens)]
        if self.chat:
            return chat_logprobs(self.tokenizer, tokens, values)
        offset = len(self.tokenizer.decode(visible(out)[:start]))
        return completion_logprobs(self.tokenizer, tokens, values, offset)

    def whole(self, snap: RequestOutput, index: int) -> dict:
        """The choice of a finished request, non-streamed."""
        out = snap.outputs[0]
        choice = {
            "index": index,
            "finish_reason": out.finish_reason,
            "avg_decoded_tokens_per_iter": out.avg_decoded_tokens_per_iter,
        }
        if not self.chat:
            choice["text"] = out.text
        elif self.reasoning_parser is None:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            split = self.reasoning_parser.parse(out.text)
            choice["message"] = {
                "role": "assistant",
                "content": split.content,
                "reasoning_content": split.reasoning_content or None,
            }
        if out.logprobs is not None:
            choice["logprobs"] = self.logprobs(out, 0)
        return choice


class ChoiceStream:
    """One choice's stream chunks: the text not sent yet, held back while a stop string may
    still complete (and, with a reasoning parser, while a marker may); split into
    ``reasoning_content`` and ``content``; the role on the first chunk; the logprobs of the
    tokens not sent yet."""

    def __init__(self, renderer: Renderer, index: int, stop: list[str] | None) -> None:
        self.renderer, self.index = renderer, index
        self.hold = max((len(s) for s in stop or []), default=1) - 1
        self.sent, self.first, self.logprobs_sent, self.emitted = "", True, 0, 0
        parser = renderer.reasoning_parser
        self.parser = None if parser is None else parser.fresh()

    def chunk(self, snap: RequestOutput) -> dict | None:
        """The choice of the next chunk, or None when there is nothing new to send."""
        out = snap.outputs[0]
        self.emitted = out.num_tokens
        text = out.text
        shown = text if snap.finished else text[: max(len(self.sent), len(text) - self.hold)]
        delta, self.sent = shown[len(self.sent) :], shown
        reasoning = ""
        if self.parser is not None:
            split = self.parser.parse_delta(delta)
            if snap.finished:
                rest = self.parser.finish()
                split.content += rest.content
                split.reasoning_content += rest.reasoning_content
            delta, reasoning = split.content, split.reasoning_content
        if not delta and not reasoning and not snap.finished and not self.first:
            return None
        choice = {
            "index": self.index,
            "finish_reason": out.finish_reason if snap.finished else None,
        }
        if self.renderer.chat:
            message = {"role": "assistant"} if self.first else {}
            if reasoning:
                message["reasoning_content"] = reasoning
            if delta or not (self.first or reasoning):
                message["content"] = delta
            choice["delta"] = message
        else:
            choice["text"] = delta
        if out.logprobs is not None:
            choice["logprobs"] = self.renderer.logprobs(out, self.logprobs_sent)
            self.logprobs_sent = out.num_visible
        if snap.finished:
            choice["avg_decoded_tokens_per_iter"] = out.avg_decoded_tokens_per_iter
        self.first = False
        return choice
