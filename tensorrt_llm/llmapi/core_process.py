"""The engine core in a process of its own (``engine_process=True``; what ``trtllm-serve`` runs).

The front side (``LLM`` in the caller's process: tokenizing, detokenizing, stop strings, the
HTTP server) and the core (``EngineCore`` in a child process: scheduler, KV, steps, ranks) talk
over two ZeroMQ sockets on local IPC paths, messages in msgpack (``msgspec``); nothing is
unpickled:

- front -> core: ``submit`` (a request as ``request_to_json`` writes it, images included),
  ``cancel``, ``finish`` (a stop string the front found), ``call`` (a read-out, the KV report or
  the stats, or work the core starts, a constraint's compile: its reply comes when it ends),
  ``shutdown``;
- core -> front: ``ready`` (or ``failed``, with the error), then after every engine iteration one
  ``outputs`` message for the whole batch: per request touched, its new tokens and logprobs, and
  how it stands (finish reason, stop reason or error, decode iterations, accepted drafts); a
  ``reply`` per call; ``lost`` (a rank of it is gone); and every ``BEAT_S`` a ``beat``: how long
  ago its engine loop last finished an iteration.

The front keeps a mirror ``LlmRequest`` per request and applies each step's changes to it before
calling the request's ``on_update`` (on its output thread, as the engine loop's thread calls it in
one process). When the front falls behind, the messages waiting are read together and each
request's ``on_update`` is called once for all of them (outputs are cumulative: nothing is lost,
the stream's chunks just grow).

The output thread also watches the core. It is lost when its process exits (noticed within
``POLL_S``), when it says a rank of it is gone, or when no iteration of its loop has finished for
``engine_core_deadline_s`` (a step stuck in a kernel or a collective; a stopped or frozen process,
whose beats stop too). Then every request in flight ends with ``ErrorKind.RANK_LOST`` naming why
(a 503 on a server), every read-out fails with ``EngineCoreLost``, the core's process group (the
core and its ranks) is killed, and a new core starts (``RestartPolicy``); ``lost_rank`` says why
until it is ready. A stalled core is killed rather than waited for: a stuck kernel or collective
does not come back, and a core that did would still hold the KV of requests already ended here.
"""

from __future__ import annotations

import atexit
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import zmq

from tensorrt_llm._torch.executors.ranks import request_to_json
from tensorrt_llm._torch.models.checkpoint import load_config
from tensorrt_llm._torch.pyexecutor.engine_loop import Submit, Update
from tensorrt_llm._torch.pyexecutor.llm_request import (
    ErrorKind,
    FinishReason,
    LlmRequest,
    stop_reason_from_json,
)
from tensorrt_llm.llmapi.core_handle import POLL_MS, CoreHandle, EngineCoreLost, RestartPolicy
from tensorrt_llm.llmapi.core_worker import call_error, decode, encode
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from tensorrt_llm.llmapi.remote_disaggregation import RemoteDisaggregation, RemoteLoad
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import GuidedDecodingParams
from tensorrt_llm.tokenizer import TransformersTokenizer

MAX_MERGED = 64  # messages the output thread takes at once (their updates merged per request)
READ_OUT_TIMEOUT_S = 5.0  # a read-out (the KV report, the stats) not answered by then: a 503


class CoreProcess:
    """The front side's handle on an engine core in a child process: the calls ``LLM`` makes on
    an ``EngineCore``, carried over ZeroMQ; a lost core is replaced (``restart_policy``)."""

    def __init__(self, args: TorchLlmArgs) -> None:
        self.args = args
        self.config = load_config(args.model)
        self.max_seq_len = args.max_seq_len or self.config.max_position_embeddings
        self.tokenizer = (
            None
            if args.skip_tokenizer_init
            else TransformersTokenizer.from_pretrained(
                args.tokenizer or args.model, chat_template=args.chat_template
            )
        )
        self.model = self.executor = self.rank_executor = self.kv_cache_manager = None
        self.loop = None
        self.closed = False
        self.deadline_s = args.engine_core_deadline_s
        self.restart_policy = RestartPolicy()
        self.restarts = 0  # cores started after a loss
        self._lost: str | None = None
        self._watchers: dict[int, tuple[LlmRequest, Update]] = {}
        self._calls: dict[int, Future] = {}
        self._next_call = 0
        self._lock = threading.Lock()  # the commands socket, the core, the watchers, the calls
        self._closing = threading.Event()
        self._args_json = args.model_dump_json(exclude_unset=True)
        self._context = zmq.Context()
        try:
            self._core = self._started()
        except BaseException:
            self._context.term()
            raise
        info = self._core.info
        self.disaggregated = RemoteDisaggregation(
            args.cache_transceiver_config is not None, info["kv_slots_per_rank"], self._read_out
        )
        self.dtype = info["dtype"]
        self.kv_slots, self.tokens_per_block = info["kv_slots"], info["tokens_per_block"]
        self._reader = threading.Thread(
            target=self._supervise, name="trtllm-core-outputs", daemon=True
        )
        self._reader.start()
        atexit.register(self.shutdown)  # (before multiprocessing joins its children at exit)

    def _started(self) -> CoreHandle | None:
        """A new core, ready; None if the front began to shut down meanwhile. A core that fails
        to start is stopped, and its error raised."""
        core = CoreHandle(self._context, self._args_json)
        try:
            if core.wait_ready(self._closing):
                return core
        except BaseException:
            core.stop()
            raise
        core.stop()
        return None

    # ---- requests ----------------------------------------------------------------------------------
    def start(self) -> None:
        """(The core's loop runs from the start, in its process.)"""

    def submit(self, command: Submit) -> None:
        request = command.request
        if request.sampling_params.return_generation_logits:
            raise ValueError(
                "return_generation_logits needs the engine core in this process "
                "(engine_process=False)"
            )
        load = command.load_kv  # (a generation-only request's checked params)
        params = load.params if isinstance(load, RemoteLoad) else None
        message = {"op": "submit", "request": request_to_json(request), "disagg": params}
        with self._lock:
            if self._send(message):
                self._watchers[request.request_id] = (request, command.on_update)
                return
            closed = "this LLM was shut down" if self.closed else None
            lost = self._lost or closed or "the engine core's process takes no commands"
        request.fail(ErrorKind.RANK_LOST, lost)
        command.on_update(request, True)

    def cancel(self, request_id: int) -> None:
        with self._lock:  # (a request no longer watched has ended: nothing to send)
            if request_id in self._watchers:
                self._send({"op": "cancel", "request_id": request_id})

    def finish(self, request_id: int, reason: FinishReason, stop_reason: str) -> None:
        """A stop string the front found (from an ``on_update``): the mirror ends now, the core's
        request between its next steps."""
        with self._lock:
            watched = self._watchers.get(request_id)
            if watched is not None:
                watched[0].finish(reason, stop_reason)
                self._send(
                    {
                        "op": "finish",
                        "request_id": request_id,
                        "reason": reason.value,
                        "stop": stop_reason,
                    }
                )

    def run_until(self, done: threading.Event) -> None:
        """Wait for ``done`` (set from the output thread; a lost core ends every request)."""
        done.wait()

    def between_steps(self, fn):
        raise RuntimeError(
            "between_steps runs a function where the engine core is: with engine_process=True "
            "it runs in another process; use kv_cache_report() or get_stats()"
        )

    # ---- read-outs ---------------------------------------------------------------------------------
    def kv_cache_report(self) -> dict:
        return self._read_out("kv_cache_report")

    def stats(self) -> dict:
        return self._read_out("stats")

    def _read_out(self, name: str):
        """A read-out's value; ``EngineCoreLost`` when the core does not answer within
        ``READ_OUT_TIMEOUT_S`` (a step that long is what a stalled core looks like before its
        deadline)."""
        try:
            return self._call(name).result(timeout=READ_OUT_TIMEOUT_S)
        except FutureTimeout:
            raise EngineCoreLost(
                f"the engine core did not answer within {READ_OUT_TIMEOUT_S:g} s (a step that "
                "long, or a stall)"
            ) from None

    def compile_guide(self, guide: GuidedDecodingParams) -> Future:
        return self._call("compile_guide", guide.to_json())

    def _call(self, name: str, *args) -> Future:
        """``EngineCore._<name>(*args)`` where the core is, as a future (of the future's result
        where the call returns one); ``EngineCoreLost`` while the core is lost or restarting (a
        stalled core's calls fail once it passes the deadline)."""
        future: Future = Future()
        with self._lock:
            if self._lost is not None or self.closed:
                raise EngineCoreLost(self._lost or "this LLM was shut down")
            call_id, self._next_call = self._next_call, self._next_call + 1
            self._calls[call_id] = future
            self._send({"op": "call", "call_id": call_id, "name": name, "args": list(args)})
        return future

    def lost_rank(self) -> str | None:
        """Why the engine core cannot run requests now (its process exited, one of its ranks is
        gone, or it stalled; and whether another core is starting); None while it can."""
        return self._lost

    @property
    def _process(self):
        """The current core's process (tests signal it)."""
        return self._core.process

    # ---- the output thread ------------------------------------------------------------------------
    def _supervise(self) -> None:
        """Read the core's messages; when the core is lost, end its requests, kill it and start
        another (while ``restart_policy`` allows, until the LLM shuts down)."""
        while (reason := self._watch(self._core)) is not None:
            served_s = time.monotonic() - self._core.ready_at
            self._lose(reason)
            self._core.stop()
            if not self._restart(reason, served_s):
                return

    def _watch(self, core: CoreHandle) -> str | None:
        """Read ``core``'s messages until it is lost (why: its process exited, a rank of it is
        gone, or no step finished for ``deadline_s``) or it exits at shutdown (None)."""
        while True:
            if core.outputs.poll(POLL_MS) and (lost := self._read_waiting(core)) is not None:
                return lost
            if (code := core.exit_code()) is not None:
                closing = self._closing.is_set()
                return None if closing else f"the engine core's process exited (code {code})"
            closing = self._closing.is_set()  # (a core shutting down sends no beats)
            if not closing and (stall := core.heartbeat.stall(self.deadline_s)) is not None:
                return stall

    def _restart(self, reason: str, served_s: float) -> bool:
        """Start cores until one is ready (True); False if ``restart_policy`` allows no more start
        (``lost_rank`` then says so for good) or the LLM shuts down."""
        policy = self.restart_policy
        while (wait_s := policy.next_wait(served_s)) is not None:
            self._lost = (
                f"{reason}; restarting the engine core ({policy.attempts} of {policy.max_attempts})"
            )
            logger.warning("%s in %g s", self._lost, wait_s)
            if self._closing.wait(wait_s):
                return False
            try:
                core = self._started()
            except Exception as exc:
                logger.error("the engine core did not restart: %s", exc)
                served_s = 0.0
                continue
            with self._lock:
                if core is None or self.closed:
                    if core is not None:
                        core.stop()
                    return False
                self._core, self._lost = core, None
                self.restarts += 1
            logger.info("the engine core restarted (%d restart(s) so far)", self.restarts)
            return True
        tried = f" after {policy.attempts} in a row" if policy.attempts else ""
        self._lost = (
            f"{reason}; the engine core was not restarted again{tried}: the LLM must be restarted"
        )
        logger.error("%s", self._lost)
        return False

    def _read_waiting(self, core: CoreHandle) -> str | None:
        """Every message waiting (at most ``MAX_MERGED``), in order; each request's ``on_update``
        called once for all the steps among them that touched it, so a front that falls behind
        the core catches up in fewer, larger updates. The reason when the core says a rank of it
        is gone."""
        touched: dict[int, tuple[LlmRequest, Update]] = {}
        try:
            for _ in range(MAX_MERGED):
                message = decode(core.outputs.recv())
                match message["op"]:
                    case "beat":
                        core.heartbeat.heard(message["since_s"])
                    case "outputs":
                        core.heartbeat.heard()
                        self._apply(message["deltas"], touched)
                    case "reply":
                        core.heartbeat.heard()
                        with self._lock:
                            future = self._calls.pop(message["call_id"])
                        if message["error"] is None:
                            future.set_result(message["value"])
                        else:
                            future.set_exception(call_error(message))
                    case "lost":
                        return message["reason"]
                if not core.outputs.poll(0):
                    break
        finally:
            self._notify(touched)
        return None

    def _apply(self, deltas: list, touched: dict[int, tuple[LlmRequest, Update]]) -> None:
        """One step's changes into the mirrors of the requests it touched."""
        for delta in deltas:
            rid, tokens, logprobs, finish, stop, iterations, accepted, received, admitted, reply = (
                delta
            )
            with self._lock:
                watched = self._watchers.get(rid)
            if watched is None:  # (ended here already: a stop string, a lost core)
                continue
            request = watched[0]
            request.output_token_ids.extend(tokens)
            if logprobs:
                request.py_logprobs.extend(
                    (lp, [tuple(pair) for pair in top]) for lp, top in logprobs
                )
            request.num_decode_iterations = iterations
            request.num_accepted_draft_tokens = accepted
            request.received_at, request.admitted_at = received, admitted
            if finish is not None and not request.is_finished:
                request.finish(FinishReason(finish), stop_reason_from_json(stop))
            if reply is not None:
                self.disaggregated.received(rid, reply)
            touched[rid] = watched

    def _notify(self, touched: dict[int, tuple[LlmRequest, Update]]) -> None:
        """Each touched request's ``on_update``, once; a finished one is no longer watched."""
        for rid, (request, on_update) in touched.items():
            _call(on_update, request, request.is_finished)
            if request.is_finished:
                with self._lock:
                    self._watchers.pop(rid, None)
        touched.clear()

    def _lose(self, reason: str) -> None:
        """The core is gone: every request in flight ends with ``reason``, every call fails."""
        logger.error("%s: the requests in flight end", reason)
        with self._lock:
            self._lost = reason
            watched, self._watchers = list(self._watchers.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for request, on_update in watched:
            if not request.is_finished:
                request.fail(ErrorKind.RANK_LOST, reason)
            _call(on_update, request, True)
        for future in calls:
            future.set_exception(EngineCoreLost(reason))

    def _send(self, message: dict) -> bool:
        """``message`` to the core, if it runs; False if it takes none. (With the lock held.)"""
        if self._lost is not None or self.closed:
            return False
        try:
            self._core.commands.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:  # (its process is gone: the output thread is about to notice)
            return False
        return True

    # ---- lifetime ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell the core to shut down (waiting up to a minute), then kill what is left of it."""
        if self.closed:
            return
        with self._lock:
            live = self._send({"op": "shutdown"})  # (a lost core, or one restarting: nothing)
            self.closed = True  # (from here no other core starts)
            self._closing.set()
            core = self._core
        if live:
            core.wait_exit(60)
        atexit.unregister(self.shutdown)
        core.kill()
        self._reader.join(timeout=30)
        self._core.stop()
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            future.set_exception(EngineCoreLost("this LLM was shut down"))
        self._context.term()


def _call(on_update: Update, request: LlmRequest, finished: bool) -> None:
    try:
        on_update(request, finished)
    except Exception:
        logger.error(
            "update callback of request %d failed:\n%s", request.request_id, traceback.format_exc()
        )
