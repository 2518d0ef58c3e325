"""EngineLoop: continuous batching, what ``LLM`` runs its requests on.

The loop takes typed commands (``Submit``, ``Cancel``, ``Call``) from a queue, applies them
between steps, steps the executor while it has work, and after every step calls each request's
callback with the request (its tokens so far) and whether it finished. It runs on a background
thread once ``start`` is called (``LLM.submit``, a server), or on the caller's thread for as long
as ``run_until`` says (``LLM.generate`` with no server); either way every call into the executor
happens on the one thread that runs the loop. A step that raises ends (and frees) only the
requests of that batch (``fault_isolation.py``); the loop keeps serving the others.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorrt_llm._torch.pyexecutor.fault_isolation import describe
from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, LlmRequest
from tensorrt_llm.logger import logger

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.coordinator import LoadKv
    from tensorrt_llm._torch.pyexecutor.executor import Executor

Update = Callable[[LlmRequest, bool], None]
IDLE_WAIT_S = 0.5  # nothing to run: how long the loop waits for a command before looking again
TRANSFER_WAIT_S = 0.001  # only KV pulls in flight: the same, so polling them spins no core


@dataclass(frozen=True)
class Submit:
    """Start ``request``; ``load_kv`` (a generation-only request) pulls its prompt's KV from a
    context server when the executor admits it."""

    request: LlmRequest
    on_update: Update
    load_kv: LoadKv | None = None


@dataclass(frozen=True)
class Cancel:
    request_id: int


@dataclass(frozen=True)
class Call:
    """Run ``fn`` between steps and set ``future`` to its result (or its exception)."""

    fn: Callable[[], object]
    future: Future


@dataclass(frozen=True)
class _Wake:
    pass


Command = Submit | Cancel | Call | _Wake


class EngineLoop:
    def __init__(
        self,
        executor: Executor,
        housekeeping: Callable[[], object] | None = None,
        flush: Callable[[], object] | None = None,
    ) -> None:
        """``housekeeping``: run every iteration (e.g. releasing pulled KV); ``flush``: run at
        the end of every iteration, after the callbacks (an engine process sends the step's
        outputs then, once for the whole batch)."""
        self.executor = executor
        self.housekeeping = housekeeping
        self.flush = flush
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._watchers: dict[int, tuple[LlmRequest, Update]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pause = 0.0  # how long the next iteration may wait for a command

    def start(self) -> None:
        """Run the loop on a background thread from now on (once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="trtllm-engine-loop", daemon=True
                )
                self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def run_until(self, done: Callable[[], bool]) -> None:
        """Run the loop on this thread until ``done()`` (only while no background thread runs)."""
        if self.running:
            raise RuntimeError("the engine loop runs on its own thread; submit to it instead")
        while not done():
            self._iterate(wait_s=self._pause)

    def submit(self, command: Submit) -> None:
        """Queue a validated request; ``command.on_update(request, finished)`` follows it."""
        command.request.received_at = time.monotonic()
        self._commands.put(command)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the loop's thread between steps (a consistent view of the executor)."""
        future: Future = Future()
        self._commands.put(Call(fn, future))
        return future

    def cancel(self, request_id: int) -> None:
        self._commands.put(Cancel(request_id))

    @property
    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._commands.put(_Wake())
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._iterate(wait_s=IDLE_WAIT_S if not self.executor.has_work else self._pause)

    def _iterate(self, wait_s: float = 0.0) -> None:
        """Apply the queued commands (waiting up to ``wait_s`` for one), step once if there is
        work, then the housekeeping."""
        try:
            command = self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait()
        except queue.Empty:
            command = None
        while command is not None:
            try:
                self._apply(command)
            except Exception:  # (a command's own failures are its request's: the loop goes on)
                logger.error("engine command %r failed:\n%s", command, traceback.format_exc())
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        if self.executor.has_work:
            self._step()
        for hook in (self.housekeeping, self.flush):
            if hook is not None:
                try:
                    hook()
                except Exception:
                    logger.error("engine hook %r failed:\n%s", hook, traceback.format_exc())

    def _apply(self, command: Command) -> None:
        match command:
            case Submit(request, on_update, load_kv):
                try:
                    if load_kv is None:
                        self.executor.enqueue_request(request)
                    else:
                        self.executor.enqueue_generation_only(request, load_kv)
                except Exception as exc:  # a bad request or peer: it ends, the loop goes on
                    logger.warning("request %d failed to start: %s", request.request_id, exc)
                    if not request.is_finished:
                        refused = isinstance(exc, ValueError | TypeError)
                        kind = ErrorKind.INVALID_REQUEST if refused else ErrorKind.ENGINE_FAULT
                        request.fail(kind, str(exc) if refused else describe(exc))
                    self._callback(request, on_update, finished=True)
                    return
                self._watchers[request.request_id] = (request, on_update)
            case Call(fn, future):
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)
            case Cancel(request_id) if request_id in self._watchers:
                self.executor.cancel_request(request_id)
                self._notify(request_id, finished=True)

    def _step(self) -> None:
        launched = self.executor.stats.num_steps
        try:
            self.executor.step()
        except Exception:  # the executor already ended and freed that batch's requests
            logger.error("engine step failed:\n%s", traceback.format_exc())
        # nothing launched (requests wait only on KV pulls): wait a little before the next look
        self._pause = TRANSFER_WAIT_S if self.executor.stats.num_steps == launched else 0.0
        for request_id in list(self._watchers):
            request, _ = self._watchers[request_id]
            self._notify(request_id, finished=request.is_finished)

    def _notify(self, request_id: int, finished: bool) -> None:
        request, callback = self._watchers[request_id]
        self._callback(request, callback, finished)
        if finished or request.is_finished:  # (the callback may end it: a stop string)
            del self._watchers[request_id]

    @staticmethod
    def _callback(request: LlmRequest, callback: Update, finished: bool) -> None:
        try:
            callback(request, finished)
        except Exception:
            logger.error(
                "update callback of request %d failed:\n%s",
                request.request_id,
                traceback.format_exc(),
            )
