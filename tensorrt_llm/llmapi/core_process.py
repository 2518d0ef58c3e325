"""The engine core in a process of its own (``engine_process=True``; what ``trtllm-serve`` runs).

The front side (``LLM`` in the caller's process: tokenizing, detokenizing, stop strings, the
HTTP server) and the core (``EngineCore`` in a child process: scheduler, KV, steps, ranks) talk
over two ZeroMQ sockets on local IPC paths, messages in msgpack (``msgspec``); nothing is
unpickled:

- front -> core: ``submit`` (a request as ``request_to_json`` writes it, images included),
  ``cancel``, ``finish`` (a stop string the front found), ``call`` (a read-out: the KV report or
  the stats), ``shutdown``;
- core -> front: ``ready`` (or ``failed``, with the error), then after every engine iteration one
  ``outputs`` message for the whole batch: per request touched, its new tokens and logprobs, and
  how it stands (finish reason, stop reason or error, decode iterations, accepted drafts); and a
  ``reply`` per call.

The front keeps a mirror ``LlmRequest`` per request and applies each step's changes to it before
calling the request's ``on_update`` (on its output thread, as the engine loop's thread calls it in
one process). When the front falls behind, the messages waiting are read together and each
request's ``on_update`` is called once for all of them (outputs are cumulative: nothing is lost,
the stream's chunks just grow). The core's process dying is noticed within ``POLL_S``: every request in flight ends
with ``ErrorKind.RANK_LOST`` naming the exit, and ``lost_rank`` says so from then on.
"""

from __future__ import annotations

import atexit
import tempfile
import threading
import traceback
import uuid
from concurrent.futures import Future

import torch.multiprocessing as mp
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
from tensorrt_llm.llmapi.core_worker import POLL_S, core_main, decode, encode
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from tensorrt_llm.llmapi.remote_disaggregation import RemoteDisaggregation, RemoteLoad
from tensorrt_llm.logger import logger
from tensorrt_llm.tokenizer import TransformersTokenizer

READY_TIMEOUT_S = 900.0  # loading a large checkpoint, compiling and capturing graphs
MAX_MERGED = 64  # messages the output thread takes at once (their updates merged per request)


class CoreProcess:
    """The front side's handle on an engine core in a child process: the calls ``LLM`` makes on
    an ``EngineCore``, carried over ZeroMQ."""

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
        self._lost: str | None = None
        self._watchers: dict[int, tuple[LlmRequest, Update]] = {}
        self._calls: dict[int, Future] = {}
        self._next_call = 0
        self._lock = threading.Lock()  # the commands socket, the watchers and the calls
        self._dir = tempfile.TemporaryDirectory(prefix="trtllm-core-")
        commands_path = f"ipc://{self._dir.name}/commands"
        outputs_path = f"ipc://{self._dir.name}/outputs"
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.bind(commands_path)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(outputs_path)
        spawn = mp.get_context("spawn")
        self._process = spawn.Process(
            target=core_main,
            args=(args.model_dump_json(exclude_unset=True), commands_path, outputs_path),
            name=f"trtllm-engine-core-{uuid.uuid4().hex[:6]}",
        )
        self._process.start()
        try:
            info = self._wait_ready()
        except BaseException:
            self._stop_process()
            raise
        self.disaggregated = RemoteDisaggregation(
            args.cache_transceiver_config is not None, info["kv_slots_per_rank"], self._call
        )
        self.dtype = info["dtype"]
        self.kv_slots, self.tokens_per_block = info["kv_slots"], info["tokens_per_block"]
        self._reader = threading.Thread(target=self._read, name="trtllm-core-outputs", daemon=True)
        self._reader.start()
        atexit.register(self.shutdown)  # (before multiprocessing joins its children at exit)

    def _wait_ready(self) -> dict:
        waited = 0.0
        while waited < READY_TIMEOUT_S:
            if self._outputs.poll(int(POLL_S * 1000)):
                message = decode(self._outputs.recv())
                if message["op"] == "failed":
                    raise RuntimeError(f"the engine core failed to start:\n{message['error']}")
                return message["info"]
            waited += POLL_S
            if not self._process.is_alive():
                raise RuntimeError(
                    f"the engine core's process exited (code {self._process.exitcode}) before "
                    "it was ready"
                )
        raise RuntimeError(f"the engine core was not ready in {READY_TIMEOUT_S} s")

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
        with self._lock:
            if self._lost is None:
                self._watchers[request.request_id] = (request, command.on_update)
                load = command.load_kv  # (a generation-only request's checked params)
                params = load.params if isinstance(load, RemoteLoad) else None
                self._send({"op": "submit", "request": request_to_json(request), "disagg": params})
                return
        request.fail(ErrorKind.RANK_LOST, self._lost)
        command.on_update(request, True)

    def cancel(self, request_id: int) -> None:
        with self._lock:  # (a request no longer watched has ended: nothing to send)
            if self._lost is None and not self.closed and request_id in self._watchers:
                self._send({"op": "cancel", "request_id": request_id})

    def finish(self, request_id: int, reason: FinishReason, stop_reason: str) -> None:
        """A stop string the front found (from an ``on_update``): the mirror ends now, the core's
        request between its next steps."""
        with self._lock:
            watched = self._watchers.get(request_id)
            if watched is not None:
                watched[0].finish(reason, stop_reason)
            if self._lost is None:
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
        return self._call("kv_cache_report")

    def stats(self) -> dict:
        return self._call("stats")

    def _call(self, name: str) -> dict:
        future: Future = Future()
        with self._lock:
            if self._lost is not None:
                raise RuntimeError(self._lost)
            call_id, self._next_call = self._next_call, self._next_call + 1
            self._calls[call_id] = future
            self._send({"op": "call", "call_id": call_id, "name": name})
        return future.result()

    def lost_rank(self) -> str | None:
        """Why the engine core's process (or one of its ranks) is gone; None while all run."""
        return self._lost

    # ---- the output thread -------------------------------------------------------------------------
    def _read(self) -> None:
        while not self.closed:
            try:
                ready = self._outputs.poll(int(POLL_S * 1000))
            except zmq.ZMQError:  # (closed under it at shutdown)
                return
            if not ready:
                if not self._process.is_alive() and not self.closed:
                    self._lose(f"the engine core's process exited (code {self._process.exitcode})")
                    return
                continue
            if not self._read_waiting():
                return

    def _read_waiting(self) -> bool:
        """Every message waiting (at most ``MAX_MERGED``), in order; each request's ``on_update``
        called once for all the steps among them that touched it, so a front that falls behind
        the core catches up in fewer, larger updates. False once the core has closed."""
        touched: dict[int, tuple[LlmRequest, Update]] = {}
        try:
            for _ in range(MAX_MERGED):
                message = decode(self._outputs.recv())
                match message["op"]:
                    case "outputs":
                        self._apply(message["deltas"], touched)
                    case "reply":
                        with self._lock:
                            future = self._calls.pop(message["call_id"])
                        if message["error"] is not None:
                            future.set_exception(AssertionError(message["error"]))
                        else:
                            future.set_result(message["value"])
                    case "lost":
                        self._notify(touched)
                        self._lose(message["reason"])
                    case "closed":
                        return False
                if not self._outputs.poll(0):
                    break
        except zmq.ZMQError:  # (closed under it at shutdown)
            return False
        finally:
            self._notify(touched)
        return True

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
        """The core is gone: every request in flight ends with ``reason``."""
        logger.error("%s: the requests in flight end; the LLM must be restarted", reason)
        with self._lock:
            self._lost = reason
            watched, self._watchers = list(self._watchers.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for request, on_update in watched:
            if not request.is_finished:
                request.fail(ErrorKind.RANK_LOST, reason)
            _call(on_update, request, True)
        for future in calls:
            future.set_exception(RuntimeError(reason))

    def _send(self, message: dict) -> None:  # (with the lock held)
        self._commands.send(encode(message))

    # ---- lifetime ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.closed:
            return
        with self._lock:
            if self._process.is_alive():  # (also after a rank under it was lost)
                self._send({"op": "shutdown"})
        self._process.join(timeout=60)
        self.closed = True
        atexit.unregister(self.shutdown)
        self._reader.join(timeout=2 * POLL_S + 1)
        self._stop_process()

    def _stop_process(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        self._dir.cleanup()


def _call(on_update: Update, request: LlmRequest, finished: bool) -> None:
    try:
        on_update(request, finished)
    except Exception:
        logger.error(
            "update callback of request %d failed:\n%s", request.request_id, traceback.format_exc()
        )
