"""The engine core's process (``core_process.py`` starts it): build the ``EngineCore``, report
ready, then apply the front's commands while the engine loop runs, and send each iteration's
outputs once for the whole batch. Every ``BEAT_S`` the command thread sends a ``beat`` that says
how long ago the engine loop last finished an iteration (it finishes one at least every
``IDLE_WAIT_S`` when idle, after every step when busy): the front tells a core whose loop is
stuck in one step from an idle one by it, and a core that sends nothing at all by the beats'
absence. The process leads a process group of its own, which its ranks join, so the front can
end all of them at once. It ends on ``shutdown`` or when the front's process is gone."""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import zmq

from tensorrt_llm._torch.executors.ranks import request_from_json
from tensorrt_llm._torch.pyexecutor.engine_loop import Submit
from tensorrt_llm._torch.pyexecutor.llm_request import (
    ErrorKind,
    FinishReason,
    LlmRequest,
    stop_reason_to_json,
)
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from tensorrt_llm.llmapi.workers import freeze_startup_heap, leave_a_core, rank_device
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import SamplingParamsError

POLL_S = 0.5  # how often the core looks whether the front's process still runs
BEAT_S = 0.5  # how often the core says how its engine loop stands
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder().decode


class _Outputs:
    """The core's side of the outputs socket: each request's changes since it was last sent,
    gathered over one engine iteration and sent as one message (``flush``, at the end of every
    iteration, on the loop's thread), and the beats (``beat``, on the command thread)."""

    def __init__(self, socket: zmq.Socket, reply: Callable[[LlmRequest], object | None]) -> None:
        self.socket = socket
        self.reply = reply  # a finished request's disaggregated reply, if any
        self.deltas: list = []
        self.sent: dict[int, tuple[int, int]] = {}  # request id -> tokens, logprobs sent
        self.flushed_at = time.monotonic()  # when the loop last finished an iteration
        self._lock = threading.Lock()  # (two threads send)

    def update(self, request: LlmRequest, finished: bool) -> None:
        rid = request.request_id
        tokens, logprobs = self.sent.get(rid, (0, 0))
        finished = finished or request.is_finished
        reply = self.reply(request) if finished else None
        self.deltas.append(
            (
                rid,
                request.output_token_ids[tokens:],
                request.py_logprobs[logprobs:] or None,  # (tuples go as msgpack arrays)
                request.finish_reason.value if finished and request.finish_reason else None,
                stop_reason_to_json(request.stop_reason) if finished else None,
                request.num_decode_iterations,
                request.num_accepted_draft_tokens,
                request.received_at,
                request.admitted_at,
                None if reply is None else reply.to_json(),
            )
        )
        if finished:
            self.sent.pop(rid, None)
        else:
            self.sent[rid] = (len(request.output_token_ids), len(request.py_logprobs))

    def send(self, message: dict) -> None:
        with self._lock:
            self.socket.send(encode(message))

    def flush(self) -> None:
        if self.deltas:
            deltas, self.deltas = self.deltas, []
            self.send({"op": "outputs", "deltas": deltas})
        self.flushed_at = time.monotonic()

    def beat(self) -> None:
        self.send({"op": "beat", "since_s": time.monotonic() - self.flushed_at})


def core_main(args_json: str, commands_path: str, outputs_path: str) -> None:
    """The engine core's process: build, report ready, serve commands until ``shutdown`` or the
    front's process is gone."""
    from tensorrt_llm.llmapi.engine_core import EngineCore

    os.setpgrp()  # (before the ranks start: they join it)
    parent = os.getppid()
    context = zmq.Context()
    outputs_socket = context.socket(zmq.PUSH)
    outputs_socket.connect(outputs_path)
    commands = context.socket(zmq.PULL)
    commands.connect(commands_path)
    try:  # (the loop flushes the outputs once it runs, after they exist)
        args = TorchLlmArgs.model_validate_json(args_json)
        leave_a_core(rank_device(args.device, args.mapping()), "the front")
        core = EngineCore(args, lambda: outputs.flush())
    except BaseException:
        outputs_socket.send(encode({"op": "failed", "error": traceback.format_exc()}))
        return
    outputs = _Outputs(outputs_socket, core.disaggregated.reply)
    info = {
        "kv_slots_per_rank": core.limits.kv_usable_slots,
        "dtype": str(core.dtype).removeprefix("torch."),
        "kv_slots": core.limits.kv_slots,
        "tokens_per_block": core.limits.tokens_per_block,
    }
    freeze_startup_heap()
    outputs.send({"op": "ready", "info": info})
    core.loop.start()
    told = False  # the front, of a lost rank
    beaten = 0.0
    try:
        while os.getppid() == parent:
            if time.monotonic() - beaten >= BEAT_S:
                outputs.beat()
                beaten = time.monotonic()
            if not commands.poll(int(BEAT_S * 1000)):
                lost = core.lost_rank()
                if lost is not None and not told:
                    told = True  # (sent from this thread: the loop may wait on the lost rank)
                    outputs.send({"op": "lost", "reason": lost})
                continue
            if not _apply_waiting(core, outputs, commands):
                break
    finally:
        core.shutdown()
        outputs.send({"op": "closed"})
        outputs_socket.close(linger=1000)
        commands.close(linger=0)
        context.term()


def _apply_waiting(core, outputs: _Outputs, commands: zmq.Socket) -> bool:
    """Every command waiting, in order, in one go: while the loop's thread runs a step this
    thread waits for the interpreter's lock each time it wakes, so it takes all that came rather
    than one per wake. False at ``shutdown``."""
    while True:
        try:
            message = decode(commands.recv(zmq.NOBLOCK))
        except zmq.Again:
            return True
        if message["op"] == "shutdown":
            return False
        _apply_command(core, outputs, message)


def _apply_command(core, outputs: _Outputs, message: dict) -> None:
    match message["op"]:
        case "submit":
            try:
                request = request_from_json(message["request"])
            except Exception as exc:  # (the front checked it: a mismatch of the two sides)
                logger.error("a submitted request could not be read: %s", exc)
                return
            load_kv = None
            if message["disagg"] is not None:
                try:  # (checked by the front: here the pull is made ready)
                    load_kv = core.disaggregated.prepare(request, message["disagg"])
                except Exception as exc:
                    kind = (
                        ErrorKind.INVALID_REQUEST
                        if isinstance(exc, ValueError)
                        else ErrorKind.ENGINE_FAULT
                    )
                    request.fail(kind, str(exc))
                    outputs.update(request, True)
                    return
            core.loop.submit(Submit(request, outputs.update, load_kv))
        case "cancel":
            core.cancel(message["request_id"])
        case "finish":
            rid, reason, stop = message["request_id"], message["reason"], message["stop"]
            core.loop.call(lambda: core.finish(rid, FinishReason(reason), stop))
        case "call":
            call_id, fn = message["call_id"], getattr(core, f"_{message['name']}")
            args = message["args"]

            def answer(future: Future) -> None:  # (on the loop's thread, or a future's)
                error = future.exception()
                value = None if error is not None else future.result()
                if isinstance(value, Future):  # (a call that starts work: its result when done)
                    value.add_done_callback(answer)
                    return
                kind = None if error is None else type(error).__name__
                text = None if error is None else str(error)
                field = error.field if isinstance(error, SamplingParamsError) else None
                reply = {"call_id": call_id, "value": value, "error": text, "kind": kind}
                reply["field"] = field  # (a request's field: what its error names)
                outputs.send({"op": "reply", **reply})

            core.loop.call(lambda: fn(*args)).add_done_callback(answer)


def call_error(reply: dict) -> Exception:
    """A call's error, as the core raised it: a request field's (``SamplingParamsError``), a
    broken invariant (``AssertionError``), a refused argument (``ValueError``); else a
    ``RuntimeError`` naming its type."""
    if reply["field"] is not None:
        return SamplingParamsError(reply["field"], reply["error"])
    kind = {"AssertionError": AssertionError, "ValueError": ValueError}.get(reply["kind"])
    return kind(reply["error"]) if kind else RuntimeError(f"{reply['kind']}: {reply['error']}")
