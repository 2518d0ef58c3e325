"""How many connections a server holds and for how long, enforced where uvicorn reads HTTP (its
httptools protocol): a connection is never held by a client that sends nothing or trickles its
headers.

- ``header_timeout_s``: from a connection's opening, or a keep-alive request's first byte, to
  the end of its headers; past it the connection is closed (a slow-headers client holds a
  socket no longer than this). Idle keep-alive connections close after uvicorn's
  ``timeout_keep_alive`` (``commands/serve.SERVER_KEEP_ALIVE_S``), and one that trickles its body
  after the body timeout (``middleware.BODY_TIMEOUT_S``, a 408).
- ``max_connections``: connections open at once; the one past it gets a 503 (an OpenAI error
  object) and is closed at once, before it is read. The default stays below the process's
  file-descriptor limit, so the server never runs out of them.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 4096
FDS_KEPT = 256  # descriptors left for the server's own files, sockets and pipes


def default_max_connections() -> int:
    """``MAX_CONNECTIONS``, or fewer where the file-descriptor limit is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - FDS_KEPT))


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int | None = None  # None: default_max_connections()
    header_timeout_s: float = HEADER_TIMEOUT_S

    def protocol(self) -> type:
        """uvicorn's ``http`` protocol class (its httptools one) holding to these limits."""
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        limit = self.max_connections or default_max_connections()
        refusal = _refusal(limit)
        header_timeout_s = self.header_timeout_s

        class BoundedHttp(HttpToolsProtocol):
            def connection_made(self, transport) -> None:
                super().connection_made(transport)
                self._headers_due = None
                if len(self.connections) > limit:
                    transport.write(refusal)
                    transport.close()
                    return
                self._await_headers()

            def on_message_begin(self) -> None:
                super().on_message_begin()
                self._await_headers()

            def on_headers_complete(self) -> None:
                self._stop_waiting()
                super().on_headers_complete()

            def connection_lost(self, exc) -> None:
                self._stop_waiting()
                super().connection_lost(exc)

            def _await_headers(self) -> None:
                if self._headers_due is None:
                    self._headers_due = self.loop.call_later(header_timeout_s, self._too_slow)

            def _stop_waiting(self) -> None:
                if self._headers_due is not None:
                    self._headers_due.cancel()
                    self._headers_due = None

            def _too_slow(self) -> None:
                self._headers_due = None
                if not self.transport.is_closing():
                    self.transport.close()

        return BoundedHttp


def _refusal(limit: int) -> bytes:
    error = {
        "message": f"this server holds {limit} connections, its most at once; retry later",
        "type": "server_error",
        "param": None,
        "code": 503,
    }
    body = json.dumps({"error": error}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
