"""Where a request's constraint is built and checked before it runs: on a few threads beside the
event loop (xgrammar leaves the interpreter's lock while it builds), so ``/health``, ``/kv_cache``
and running streams never wait on it.

- At most ``max_builds`` at once; a request past that is a 503 (retry later). A build that ran
  past its deadline still counts until it really ends: a thread cannot be stopped, so the count
  is what bounds the CPU that slow constraints take.
- Each within ``deadline_s``: past it the request is a 400 naming its constraint's field.

The size limits a constraint is held to before this (``grammar_limits.py``) keep every build of
a legal constraint far inside the deadline; the deadline is what catches the rest (a regular
expression's repetition counts, say).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tensorrt_llm.sampling_params import GuidedDecodingParams
from tensorrt_llm.serve.errors import ServerError

MAX_BUILDS = 4  # constraints built at once (the rest: a 503)
BUILD_DEADLINE_S = 10.0  # a constraint not built by then: a 400


class GrammarGate:
    def __init__(self, max_builds: int = MAX_BUILDS, deadline_s: float = BUILD_DEADLINE_S) -> None:
        self.max_builds, self.deadline_s = max_builds, deadline_s
        self._pool = ThreadPoolExecutor(max_builds, thread_name_prefix="trtllm-grammar-check")
        self._lock = threading.Lock()
        self._building = 0  # builds started and not ended, past their deadline or not

    @property
    def building(self) -> int:
        return self._building

    async def build(
        self, make: Callable[[], GuidedDecodingParams | None], param: Callable[[], str]
    ) -> GuidedDecodingParams | None:
        """``make()``'s constraint, made on the gate's threads (it raises ``ServerError`` for a
        constraint that cannot be held to); ``param()``: the field a deadline's 400 names."""
        with self._lock:
            if self._building >= self.max_builds:
                raise ServerError(
                    503,
                    f"this server is building {self._building} output constraints (grammars), "
                    f"its most at once; retry later",
                    "server_error",
                )
            self._building += 1
        future = self._pool.submit(make)
        future.add_done_callback(self._ended)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.deadline_s)
        except TimeoutError:
            field = param()
            raise ServerError(
                400,
                f"{field}: its grammar was not built within {self.deadline_s:g} s; make the "
                "constraint smaller or simpler",
                param=field,
            ) from None

    def _ended(self, _: Future) -> None:
        with self._lock:
            self._building -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
