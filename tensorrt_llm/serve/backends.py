"""The router's view of its servers: which answer their ``/health``, and which one takes the next
request (round robin over those that do).

A watcher checks every server every ``interval_s``; a server whose check fails ``DOWN_AFTER``
times in a row (no answer within ``timeout_s``, or not a 200) is skipped until a check succeeds
again, and so is a server the router could not reach with a request (``failed``). A request the
router is waiting on at a server marked down is given up (``wait_on``) instead of waiting out its
timeout: a server that is frozen, not just busy, stops answering ``/health`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field

import httpx

DOWN_AFTER = 3  # failed checks in a row that take a server out of the rotation
CHECK_INTERVAL_S = 1.0
CHECK_TIMEOUT_S = 5.0  # a server loaded enough to take longer is still up
RECHECK_TIMEOUT_S = 1.0
WAIT_POLL_S = 0.1


class ServerDown(Exception):
    """The server a request waited on stopped answering its health checks."""


@dataclass
class _Server:
    url: str
    failures: int = 0  # checks failed in a row
    down_since: float | None = None  # time.monotonic() it left the rotation

    @property
    def up(self) -> bool:
        return self.down_since is None


@dataclass
class Backends:
    """One role's servers (context or generation)."""

    role: str
    urls: list[str]
    servers: dict[str, _Server] = field(init=False)

    def __post_init__(self) -> None:
        self.servers = {url: _Server(url) for url in self.urls}
        self._order = itertools.cycle(self.urls)

    def up(self) -> list[str]:
        return [url for url, s in self.servers.items() if s.up]

    def down(self) -> list[str]:
        return [url for url, s in self.servers.items() if not s.up]

    def next(self, exclude: tuple[str, ...] = ()) -> str | None:
        """The next server in the rotation that is up (and not in ``exclude``); None if none."""
        for _ in range(len(self.urls)):
            url = next(self._order)
            if self.servers[url].up and url not in exclude:
                return url
        return None

    def failed(self, url: str) -> None:
        """A request could not reach ``url``: out of the rotation until a check succeeds."""
        server = self.servers[url]
        server.failures = max(server.failures, DOWN_AFTER)
        server.down_since = server.down_since or time.monotonic()

    def checked(self, url: str, ok: bool) -> None:
        server = self.servers[url]
        if ok:
            server.failures, server.down_since = 0, None
            return
        server.failures += 1
        if server.failures >= DOWN_AFTER and server.up:
            server.down_since = time.monotonic()

    async def recheck(self, client: httpx.AsyncClient) -> None:
        """Check the servers that are down once more, now (none up: before a request is refused,
        since one may have come back since the watcher's last round)."""
        down = self.down()
        results = await asyncio.gather(*(check(client, url, RECHECK_TIMEOUT_S) for url in down))
        for url, ok in zip(down, results, strict=True):
            if ok:
                self.checked(url, ok)

    async def wait_on(self, url: str, awaitable):
        """``awaitable``'s result, or ``ServerDown`` as soon as ``url`` is marked down meanwhile
        (the awaitable is then cancelled)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=WAIT_POLL_S)
                if not task.done() and not self.servers[url].up:
                    raise ServerDown(f"{self.role} server {url} stopped answering /health")
            return task.result()
        finally:
            if not task.done():
                task.cancel()


async def check(client: httpx.AsyncClient, url: str, timeout_s: float | None = None) -> bool:
    try:
        reply = await client.get(url + "/health", timeout=timeout_s or CHECK_TIMEOUT_S)
        return reply.status_code == 200
    except httpx.HTTPError:
        return False


async def watch(client: httpx.AsyncClient, roles: list[Backends]) -> None:
    """Check every server of ``roles`` every ``CHECK_INTERVAL_S``, all at once."""
    while True:
        pairs = [(role, url) for role in roles for url in role.urls]
        results = await asyncio.gather(*(check(client, url) for _, url in pairs))
        for (role, url), ok in zip(pairs, results, strict=True):
            role.checked(url, ok)
        await asyncio.sleep(CHECK_INTERVAL_S)


@contextlib.asynccontextmanager
async def watching(client: httpx.AsyncClient, roles: list[Backends]):
    task = asyncio.ensure_future(watch(client, roles))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
