"""One HTTP request's choices (``n`` samples of each prompt) as engine requests, and the stream of
each one's outputs.

- Every choice is checked before any is submitted: one the LLM refuses is a 400 for the request,
  and nothing of it runs.
- Fair share: at most ``max_running`` choices of one request run at once (the server gives it
  half the batch); the others start as those end, so one request of many samples leaves room for
  the requests sent after it.
- With ``shared_prefix`` (``n`` samples of one prompt) the first runs alone until its prompt is
  prefilled; the others then reuse its prompt KV from the prefix cache.
- A stream left early (a client gone, a cancelled task) cancels its request, which frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tensorrt_llm.llmapi.llm import LLM, GenerationRequest, RequestOutput
from tensorrt_llm.serve.errors import ServerError
from tensorrt_llm.serve.metrics import RequestTimer
from tensorrt_llm.serve.waits import after, signal_first


@dataclass
class _Running:
    outputs: asyncio.Queue[RequestOutput]
    request_id: int = -1


class Submission:
    def __init__(
        self,
        llm: LLM,
        jobs: list[GenerationRequest],
        timer: RequestTimer,
        shared_prefix: bool,
        max_running: int,
        param: str,
    ) -> None:
        """Submit the first choices now (``ServerError`` 400 naming ``param`` if the LLM refuses
        one); ``streams`` yields each choice's outputs, in order; ``ids`` the requests started
        and not finished."""
        self.llm = llm
        self.ids: list[int] = []
        try:
            for job in jobs[1:]:  # (the first is checked when it is submitted)
                llm.check(job)
            first = jobs[:1] if shared_prefix else jobs[:max_running]
            started = [self._start(job) for job in first]
        except (ValueError, TypeError) as exc:
            self.cancel()
            raise ServerError(400, str(exc), param=param) from None
        except BaseException:  # nothing of it runs unanswered
            self.cancel()
            raise
        # a choice that starts later takes a room that one that ends gives back
        rooms = asyncio.Semaphore(max_running - len(started))
        streams = [_give_back(self._updates(r, timer.fork()), rooms) for r in started]
        later = [self._later(job, timer.fork(), rooms) for job in jobs[len(started) :]]
        if shared_prefix and later:
            prefilled = asyncio.Event()
            streams[0] = signal_first(streams[0], prefilled)
            later = [after(prefilled, stream) for stream in later]
        self.streams: list[AsyncIterator[RequestOutput]] = streams + later

    def cancel(self) -> None:
        """End every request started for this submission and not finished (the others never
        start)."""
        for request_id in self.ids:
            self.llm.cancel(request_id)

    def _start(self, job: GenerationRequest) -> _Running:
        """Submit ``job``; its outputs arrive in the returned queue (from the engine's thread)."""
        running = _Running(asyncio.Queue())
        mailbox = _Mailbox.of(asyncio.get_running_loop())

        def on_update(output: RequestOutput) -> None:  # on the engine loop's thread
            mailbox.post(running.outputs, output)

        running.request_id = self.llm.submit(job, on_update)
        self.ids.append(running.request_id)
        return running

    async def _later(self, job: GenerationRequest, timer: RequestTimer, rooms: asyncio.Semaphore):
        async with rooms:
            async for output in self._updates(self._start(job), timer):
                yield output

    async def _updates(
        self, running: _Running, timer: RequestTimer
    ) -> AsyncIterator[RequestOutput]:
        """A submitted request's outputs, one per step that touched it, or (when this stream
        falls behind the engine) the latest of those waiting: each output holds everything so
        far. Leaving early (a disconnected client, a cancelled task) cancels the request and
        frees its slots."""
        finished = False
        try:
            while not finished:
                output = await running.outputs.get()
                while not output.finished and not running.outputs.empty():
                    output = running.outputs.get_nowait()
                finished = output.finished
                out = output.outputs[0]
                al = out.avg_decoded_tokens_per_iter
                timer.update(out.num_tokens, output.admitted_at, finished, al, output.received_at)
                yield output
        finally:  # (the request is ended: the submission's end has nothing left to send)
            self.ids.remove(running.request_id)
            if not finished:
                self.llm.cancel(running.request_id)


async def _give_back(stream, rooms: asyncio.Semaphore):
    """``stream``; when it ends, its room goes to a choice waiting for one."""
    try:
        async for output in stream:
            yield output
    finally:
        await stream.aclose()  # (left early: its request is cancelled now, not when collected)
        rooms.release()


class _Mailbox:
    """Outputs handed from the engine's thread to one event loop: they gather here and the loop
    is woken once for all that came meanwhile (a step's outputs for every stream at once), not
    once per output."""

    _of_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.waiting: list[tuple[asyncio.Queue, RequestOutput]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        mailbox = cls._of_loop.get(loop)
        if mailbox is None:
            mailbox = cls._of_loop[loop] = cls(loop)
        return mailbox

    def post(self, queue: asyncio.Queue, output: RequestOutput) -> None:
        with self.lock:
            self.waiting.append((queue, output))
            if len(self.waiting) > 1:  # (a wake-up is already on its way)
                return
        with contextlib.suppress(RuntimeError):  # (a closed loop: nobody reads these any more)
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for queue, output in waiting:
            queue.put_nowait(output)
