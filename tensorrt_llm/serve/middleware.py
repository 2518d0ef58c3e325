"""The guards every request passes before a handler runs (plain ASGI middleware): the API key,
and a body limit that counts the bytes as they arrive.

The body limit does not trust the headers: a chunked body has no ``Content-Length``, so the bytes
are counted as they come in and the request is refused (413) the moment they pass the limit, with
at most one chunk past it ever held; a body that has not all come within ``BODY_TIMEOUT_S`` is
refused (408), so a client that trickles its body holds a connection no longer than that. A
request that carries both ``Content-Length`` and
``Transfer-Encoding``, or two lengths, is refused (400): front ends disagree on which one wins,
which is how requests are smuggled past them.
"""

from __future__ import annotations

import asyncio
import hmac

from tensorrt_llm.serve.openai_protocol import ErrorInfo, ErrorResponse

MAX_BODY_BYTES = 8 * 2**20  # a larger request body is refused (413)
BODY_TIMEOUT_S = 60.0  # a body not all come by then is refused (408): a trickle holds no socket


async def send_error(send, status: int, message: str, kind: str) -> None:
    """An OpenAI error object as a whole response, from inside a middleware."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status))
    data = body.model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class BodySizeLimit:
    """Reads a request's body, counting it, before the app sees it; the app then reads the same
    messages (and, after them, whatever the client sends next: a disconnect still reaches it)."""

    def __init__(
        self, app, max_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S
    ) -> None:
        self.app, self.max_bytes, self.body_timeout_s = app, max_bytes, body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check_headers(scope["headers"])
        if refusal is not None:
            await send_error(send, *refusal, "invalid_request_error")
            return
        messages, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    messages.append(message)
                    if message["type"] != "http.request":
                        break  # a disconnect: the app sees it in turn
                    size += len(message.get("body", b""))
                    if size > self.max_bytes:
                        too_large = self._too_large(f"over {size}")
                        await send_error(send, 413, too_large, "invalid_request_error")
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            message = f"the request body did not all come within {self.body_timeout_s:g} s"
            await send_error(send, 408, message, "invalid_request_error")
            return

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> str:
        return f"the request body is {size} bytes; the limit is {self.max_bytes}"

    def _check_headers(self, headers) -> tuple[int, str] | None:
        lengths = [v for k, v in headers if k.lower() == b"content-length"]
        encodings = [v for k, v in headers if k.lower() == b"transfer-encoding"]
        if lengths and encodings:
            return 400, "a request may not carry both Content-Length and Transfer-Encoding"
        if len(lengths) > 1:
            return 400, "a request may carry one Content-Length"
        if lengths:
            length = lengths[0].decode("latin-1").strip()
            if not length.isdigit():
                return 400, f"Content-Length {length[:32]!r} is not a number of bytes"
            if int(length) > self.max_bytes:
                return 413, self._too_large(length)
        return None


class ApiKey:
    """With an API key set, every path but ``/health`` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing or wrong API key (Authorization: Bearer <key>)"
                await send_error(send, 401, message, "authentication_error")
                return
        await self.app(scope, receive, send)
