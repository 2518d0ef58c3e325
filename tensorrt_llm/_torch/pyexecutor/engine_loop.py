"""EngineLoop: continuous batching on a background thread, for servers.

Every call into the executor happens on the loop's thread. Other threads hand it commands (submit,
cancel) through a queue and get progress back through a callback, invoked on the loop's thread
after each step with the request (its tokens so far) and whether it finished. A step that raises
ends (and frees) only the requests of that batch, with ``FinishReason.ERROR``; the loop keeps
serving the others.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future

from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm.logger import logger

Update = Callable[[LlmRequest, bool], None]


class EngineLoop:
    def __init__(
        self, executor: PyExecutor, housekeeping: Callable[[], object] | None = None
    ) -> None:
        self.executor = executor
        self._housekeeping = housekeeping  # run every iteration (e.g. releasing pulled KV)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._watchers: dict[int, tuple[LlmRequest, Update]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trtllm-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, request: LlmRequest, on_update: Update) -> None:
        """Queue a validated request; ``on_update(request, finished)`` follows its progress."""
        self._commands.put(("submit", request, on_update))

    def submit_generation_only(
        self, request: LlmRequest, load_kv: Callable[[LlmRequest], int], on_update: Update
    ) -> None:
        """Queue a request whose prompt KV ``load_kv`` pulls from a context server."""
        self._commands.put(("generation_only", (request, load_kv), on_update))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the loop's thread between steps (a consistent view of the executor)."""
        future: Future = Future()
        self._commands.put(("call", fn, future))
        return future

    def cancel(self, request_id: int) -> None:
        self._commands.put(("cancel", request_id, None))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.executor.has_work
            try:
                command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.executor.has_work:
                self._step()
            if self._housekeeping is not None:
                try:
                    self._housekeeping()
                except Exception:
                    logger.error("engine housekeeping failed:\n%s", traceback.format_exc())

    def _apply(self, command) -> None:
        kind, payload, callback = command
        if kind == "submit":
            try:
                self.executor.enqueue_request(payload)
            except ValueError as exc:
                payload.finish(FinishReason.ERROR, str(exc))
                callback(payload, True)
                return
            self._watchers[payload.request_id] = (payload, callback)
        elif kind == "generation_only":
            request, load_kv = payload
            try:
                self.executor.enqueue_generation_only(request, load_kv)
            except Exception as exc:  # a bad peer or no slots: this request ends, the loop goes on
                request.finish(FinishReason.ERROR, str(exc))
                callback(request, True)
                return
            self._watchers[request.request_id] = (request, callback)
        elif kind == "call":
            try:
                callback.set_result(payload())
            except Exception as exc:
                callback.set_exception(exc)
        elif kind == "cancel" and payload in self._watchers:
            self.executor.cancel_request(payload)
            self._notify(payload, finished=True)

    def _step(self) -> None:
        try:
            self.executor.step()
        except Exception:  # the executor already ended and freed that batch's requests
            logger.error("engine step failed:\n%s", traceback.format_exc())
        for request_id in list(self._watchers):
            request, _ = self._watchers[request_id]
            self._notify(request_id, finished=request.is_finished)

    def _notify(self, request_id: int, finished: bool) -> None:
        request, callback = self._watchers[request_id]
        if finished:
            del self._watchers[request_id]
        try:
            callback(request, finished)
        except Exception:
            logger.error(
                "update callback of request %d failed:\n%s", request_id, traceback.format_exc()
            )
