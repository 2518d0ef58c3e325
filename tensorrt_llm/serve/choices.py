"""The choices of a reply: what one request's snapshots render to, whole or as stream chunks, and
the merge of several requests' snapshots (``n`` samples, a list of prompts) into one stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason
from tensorrt_llm.serve.logprobs import chat_logprobs, completion_logprobs
from tensorrt_llm.tokenizer import TransformersTokenizer


@dataclass
class Snapshot:
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    text_limit: int | None
    avg_decoded_tokens_per_iter: float | None
    disaggregated_params: DisaggregatedParams | None = None
    admitted_at: float | None = None  # time.monotonic() when the scheduler granted its KV
    logprobs: list | None = None  # LlmRequest.py_logprobs, when asked for


def visible(snap: Snapshot) -> list[int]:
    """The output tokens the text shows (an end token that stopped it is not shown)."""
    tokens = snap.token_ids
    if snap.finish_reason is FinishReason.STOP and isinstance(snap.stop_reason, int):
        tokens = tokens[:-1]
    return tokens


class Renderer:
    def __init__(self, tokenizer: TransformersTokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat

    def text(self, snap: Snapshot) -> str:
        text = self.tokenizer.decode(visible(snap))
        return text if snap.text_limit is None else text[: snap.text_limit]

    def logprobs(self, snap: Snapshot, start: int) -> dict:
        """The logprobs of the visible tokens from ``start`` on."""
        tokens = visible(snap)[start:]
        values = snap.logprobs[start : start + len(tokens)]
        if self.chat:
            return chat_logprobs(self.tokenizer, tokens, values)
        offset = len(self.tokenizer.decode(visible(snap)[:start]))
        return completion_logprobs(self.tokenizer, tokens, values, offset)

    def whole(self, snap: Snapshot, index: int) -> dict:
        """The choice of a finished request, non-streamed."""
        text = self.text(snap)
        choice = {
            "index": index,
            "finish_reason": snap.finish_reason,
            "avg_decoded_tokens_per_iter": snap.avg_decoded_tokens_per_iter,
        }
        choice |= (
            {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        )
        if snap.logprobs is not None:
            choice["logprobs"] = self.logprobs(snap, 0)
        return choice


class ChoiceStream:
    """One choice's stream chunks: the text not sent yet, held back while a stop string may
    still complete; the role on the first chunk; the logprobs of the tokens not sent yet."""

    def __init__(self, renderer: Renderer, index: int, stop: list[str] | None) -> None:
        self.renderer, self.index = renderer, index
        self.hold = max((len(s) for s in stop or []), default=1) - 1
        self.sent, self.first, self.logprobs_sent, self.emitted = "", True, 0, 0

    def chunk(self, snap: Snapshot) -> dict | None:
        """The choice of the next chunk, or None when there is nothing new to send."""
        self.emitted = len(snap.token_ids)
        text = self.renderer.text(snap)
        shown = text if snap.finished else text[: max(len(self.sent), len(text) - self.hold)]
        delta, self.sent = shown[len(self.sent) :], shown
        if not delta and not snap.finished and not self.first:
            return None
        choice = {
            "index": self.index,
            "finish_reason": snap.finish_reason if snap.finished else None,
        }
        if self.renderer.chat:
            choice["delta"] = ({"role": "assistant"} if self.first else {}) | (
                {"content": delta} if delta or not self.first else {}
            )
        else:
            choice["text"] = delta
        if snap.logprobs is not None:
            choice["logprobs"] = self.renderer.logprobs(snap, self.logprobs_sent)
            self.logprobs_sent = len(visible(snap))
        if snap.finished:
            choice["avg_decoded_tokens_per_iter"] = snap.avg_decoded_tokens_per_iter
        self.first = False
        return choice


async def merged(streams: list[AsyncIterator[Snapshot]]) -> AsyncIterator[tuple[int, Snapshot]]:
    """``(index, snapshot)`` from every stream as they come; closing this closes them all (which
    cancels their requests)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[Snapshot]) -> None:
        try:
            async for snap in stream:
                await queue.put((index, snap))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is done:
                left -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
