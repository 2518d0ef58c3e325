"""The choices of a reply: what one request's outputs (``RequestOutput``, one per step) render to,
whole or as stream chunks."""

from __future__ import annotations

from tensorrt_llm.llmapi.outputs import CompletionOutput, RequestOutput, visible_tokens
from tensorrt_llm.serve.logprobs import chat_logprobs, completion_logprobs
from tensorrt_llm.serve.reply_parsing import ReplyParsing
from tensorrt_llm.tokenizer import TransformersTokenizer


def visible(out: CompletionOutput) -> list[int]:
    return visible_tokens(out.token_ids, out.finish_reason, out.stop_reason)


class Renderer:
    def __init__(
        self,
        tokenizer: TransformersTokenizer,
        chat: bool,
        parsing: ReplyParsing | None = None,
    ) -> None:
        """``parsing`` (chat only): the reply's reasoning and tool calls read out of its text."""
        self.tokenizer, self.chat = tokenizer, chat
        self.parsing = parsing if chat else None

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
        elif self.parsing is None:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["message"], choice["finish_reason"] = self.parsing.whole(
                out.text, out.finish_reason
            )
        if out.logprobs is not None:
            choice["logprobs"] = self.logprobs(out, 0)
        return choice


class ChoiceStream:
    """One choice's stream chunks: the text not sent yet, held back while a stop string may
    still complete (and, with the reply's parsers, while a marker or markup may), read into
    ``reasoning_content``, ``content`` and ``tool_calls`` (``reply_parsing.py``); the role on the
    first chunk; the logprobs of the tokens not sent yet."""

    def __init__(self, renderer: Renderer, index: int, stop: list[str] | None) -> None:
        self.renderer, self.index = renderer, index
        self.hold = max((len(s) for s in stop or []), default=1) - 1
        self.sent, self.first, self.logprobs_sent, self.emitted = "", True, 0, 0
        self.split = None if renderer.parsing is None else renderer.parsing.stream()

    def chunk(self, snap: RequestOutput) -> dict | None:
        """The choice of the next chunk, or None when there is nothing new to send."""
        out = snap.outputs[0]
        self.emitted = out.num_tokens
        text = out.text
        shown = text if snap.finished else text[: max(len(self.sent), len(text) - self.hold)]
        delta, self.sent = shown[len(self.sent) :], shown
        parts = {"content": delta} if delta else {}
        if self.split is not None:
            parts = self.split.step(delta, snap.finished)
        if not parts and not snap.finished and not self.first:
            return None
        reason = out.finish_reason if snap.finished else None
        if reason is not None and self.split is not None:
            reason = self.split.finish_reason(reason)
        choice = {"index": self.index, "finish_reason": reason}
        if self.renderer.chat:
            message = {"role": "assistant"} if self.first else {}
            if not parts and not self.first:
                parts = {"content": ""}  # (the last chunk: its finish reason)
            choice["delta"] = message | parts
        else:
            choice["text"] = delta
        if out.logprobs is not None:
            choice["logprobs"] = self.renderer.logprobs(out, self.logprobs_sent)
            self.logprobs_sent = out.num_visible
        if snap.finished:
            choice["avg_decoded_tokens_per_iter"] = out.avg_decoded_tokens_per_iter
        self.first = False
        return choice
