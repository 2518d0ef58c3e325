"""How the server waits: on several requests' outputs merged into one stream, on the first of
``n`` samples before the others start, and on work that a client leaving should cancel; and an
event stream that ends what it drew on however it ends."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from tensorrt_llm.llmapi.outputs import RequestOutput

DISCONNECT_POLL_S = 0.25  # how often a request waiting on work checks that its client is there


class Last(bytes):
    """An event stream's last piece: sent with the response's end, in one write."""


class EndingStream(StreamingResponse):
    """An event stream that calls ``on_end`` (a function or a coroutine function) however it
    ends: also when the client left before its first event, when the stream's own cleanup never
    runs, so what it drew on (requests, a backend's reply) ends with it. A ``Last`` piece ends
    the response with it (no separate empty end)."""

    def __init__(self, content, on_end) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_end = on_end

    async def stream_response(self, send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send(start | {"headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            ended = isinstance(chunk, Last)
            body = chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            ended = self.on_end()
            if inspect.isawaitable(ended):
                await ended


async def until_finished(
    outputs: AsyncIterator[RequestOutput], request: Request, cancel: Callable[[], None]
) -> RequestOutput | None:
    """The last output of a non-streamed request, or None if its client disconnected first
    (then ``cancel()`` ends every request of the reply, which frees its KV at once, not when it
    would have ended)."""

    async def last() -> RequestOutput:
        final = None
        async for output in outputs:
            final = output
        return final

    result = await unless_disconnected(last(), request)
    if result is None:
        cancel()
    return result


async def unless_disconnected(coroutine, request: Request):
    """``coroutine``'s result, or None (it is cancelled) once the client has gone away."""
    task = asyncio.ensure_future(coroutine)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()


async def merged(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(index, snapshot)`` from every stream as they come; closing this closes them all (which
    cancels their requests). A stream that raises raises here."""
    if len(streams) == 1:  # (most requests: read directly, no task between)
        try:
            async for snap in streams[0]:
                yield 0, snap
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for snap in stream:
                await queue.put((index, snap))
        except Exception as exc:
            await queue.put((index, exc))
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
            if isinstance(item, Exception):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def signal_first(stream, event: asyncio.Event):
    """``stream``, setting ``event`` at its first snapshot (its prompt is prefilled) or its end."""
    try:
        async for snap in stream:
            event.set()
            yield snap
    finally:
        event.set()


async def after(event: asyncio.Event, stream):
    """``stream``, started (so its request submitted) only once ``event`` is set."""
    await event.wait()
    async for snap in stream:
        yield snap
