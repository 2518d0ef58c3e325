"""Where a request's constraint is made and compiled before the request runs, so that
``/health``, ``/kv_cache`` and running streams never wait on a grammar:

- the constraint is made (``ChatProtocol.guide``: the tool-call markup, the part after the
  reasoning) on a few threads beside the event loop;
- the engine compiles it (``LLM.compile_guide``: on the compiler's threads, as many as this gate
  lets in, which leave the interpreter's lock while they build; a constraint it holds compiled
  comes back at once); the request then finds it compiled. Requests that carry a constraint
  being compiled wait for that one compile;
- at most ``max_builds`` distinct constraints compile at once; a request that would start
  another waits for one to end, at most ``max_waiting`` of them: past that, or past its deadline
  before its compile starts, a 503 (retry later). A compile past the deadline still counts until
  it ends: it cannot be stopped, so the count is what bounds the CPU that slow constraints take;
- a compile that runs past the request's ``deadline_s`` is a 400 naming the constraint's field.

The size limits a constraint is held to before this (``grammar_limits.py``) keep every legal
constraint's compile far inside the deadline; the deadline catches the rest (a regular
expression's repetition counts, say).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParamsError
from tensorrt_llm.serve.errors import ServerError

MAX_BUILDS = 4  # distinct constraints compiled at once (grammar_matcher.COMPILE_THREADS)
MAX_WAITING = 64  # requests waiting to start a compile (past that: a 503)
BUILD_DEADLINE_S = 10.0  # a request's constraint not made and compiled by then: a 400 or 503
WAIT_POLL_S = 0.01
_WHICH = re.compile(r"^GuidedDecodingParams\.\w+: ")  # (the client named a field, not this)

Compile = Callable[[GuidedDecodingParams], Future]


class GrammarGate:
    def __init__(
        self,
        compile_guide: Compile,
        max_builds: int = MAX_BUILDS,
        deadline_s: float = BUILD_DEADLINE_S,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        """``compile_guide``: the engine's (``LLM.compile_guide``)."""
        self.compile_guide = compile_guide
        self.max_builds, self.deadline_s, self.max_waiting = max_builds, deadline_s, max_waiting
        self._pool = ThreadPoolExecutor(max_builds, thread_name_prefix="trtllm-grammar")
        self._lock = threading.Lock()  # (compiles end on the engine's threads)
        self._building: dict[tuple, Future] = {}  # constraint -> its compile, until it ends
        self._waiting = 0  # (on the event loop)

    async def build(
        self, make: Callable[[], GuidedDecodingParams | None], param: Callable[[], str]
    ) -> GuidedDecodingParams | None:
        """``make()``'s constraint (it raises ``ServerError`` for one that cannot be held to),
        compiled; ``param()``: the field a 400 about it names. ``EngineCoreLost`` passes
        through (a 503 at the edge)."""
        deadline = asyncio.get_running_loop().time() + self.deadline_s
        compiled = None
        try:
            async with asyncio.timeout_at(deadline):
                guide = await asyncio.wrap_future(self._pool.submit(make))
                if guide is None:
                    return None
                compiled = await self._started(guide)
                await asyncio.shield(asyncio.wrap_future(compiled))
        except TimeoutError:
            if compiled is None:  # (it waited for others': not its own doing)
                raise self._busy() from None
            field = param()
            raise ServerError(
                400,
                f"{field}: its grammar was not built within {self.deadline_s:g} s; make the "
                "constraint smaller or simpler",
                param=field,
            ) from None
        except SamplingParamsError as exc:  # (the grammar's own error)
            field = param()
            raise ServerError(400, f"{field}: {_WHICH.sub('', str(exc))}", param=field) from None
        return guide

    async def _started(self, guide: GuidedDecodingParams) -> Future:
        """``guide``'s compile, once there is room for it (``_compile``)."""
        compiled = self._compile(guide)
        if compiled is not None:
            return compiled
        if self._waiting >= self.max_waiting:
            raise self._busy()
        self._waiting += 1
        try:
            while (compiled := self._compile(guide)) is None:
                await asyncio.sleep(WAIT_POLL_S)
        finally:
            self._waiting -= 1
        return compiled

    def _busy(self) -> ServerError:
        return ServerError(
            503,
            f"this server is compiling {len(self._building)} output constraints (grammars), its "
            f"most at once, with {self._waiting} requests waiting; retry later",
            "server_error",
        )

    def _compile(self, guide: GuidedDecodingParams) -> Future | None:
        """The compile of ``guide``: the running one if it is compiling, else a new one (the
        engine's, done at once when it holds the grammar); None while ``max_builds`` others
        run."""
        key = (guide.kind, guide.text, guide.disable_any_whitespace)
        with self._lock:
            running = self._building.get(key)
            if running is not None:
                return running
            if len(self._building) >= self.max_builds:
                return None
            future = self.compile_guide(guide)
            self._building[key] = future
        # (after the lock: a compile already done calls back at once, on this thread)
        future.add_done_callback(lambda _: self._ended(key))
        return future

    def _ended(self, key: tuple) -> None:
        with self._lock:
            self._building.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
