"""One engine core's process as the front holds it (``CoreHandle``): started, waited for, watched
(its exit, its heartbeat) and killed with its ranks; and when a lost one is replaced
(``RestartPolicy``). ``core_process.py`` runs the protocol over it."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch.multiprocessing as mp
import zmq

from tensorrt_llm.llmapi.core_worker import BEAT_S, POLL_S, core_main, decode

READY_TIMEOUT_S = 900.0  # loading a large checkpoint, compiling and capturing graphs
POLL_MS = int(POLL_S * 1000)


class EngineCoreLost(RuntimeError):
    """A read-out asked of an engine core that is lost or restarting; the message says why."""


@dataclass
class RestartPolicy:
    """When a new engine core starts after one is lost: at most ``max_attempts`` starts in a row,
    the first ``backoff_s`` after the loss, each next one after twice the wait before it. A core
    that served ``stable_s`` before it was lost begins a new row."""

    max_attempts: int = 3
    backoff_s: float = 1.0
    stable_s: float = 300.0
    attempts: int = 0  # starts made in this row

    def next_wait(self, served_s: float) -> float | None:
        """The wait before the next start, after a core that served ``served_s`` (0: one that
        did not start); None: no start is left."""
        if served_s >= self.stable_s:
            self.attempts = 0
        if self.attempts >= self.max_attempts:
            return None
        self.attempts += 1
        return self.backoff_s * 2 ** (self.attempts - 1)


@dataclass
class Heartbeat:
    """A core's progress as the front sees it, on the front's clock: when it last heard from the
    core, and when the core's engine loop last finished an iteration (a ``beat`` says how long
    before it was sent; ``outputs`` are sent as one finishes). The loop finishes one at least
    every ``IDLE_WAIT_S`` when idle: a core that finishes none for the deadline is stuck in one
    step (its beats still come) or stopped or frozen whole (they stop too)."""

    heard_at: float
    stepped_at: float

    def heard(self, since_s: float = 0.0) -> None:
        """A message from the core, whose loop last finished an iteration ``since_s`` before."""
        self.heard_at = time.monotonic()
        self.stepped_at = max(self.stepped_at, self.heard_at - since_s)

    def stall(self, deadline_s: float) -> str | None:
        """Why the core counts as hung: no iteration of its loop finished for ``deadline_s``."""
        now = time.monotonic()
        if now - self.stepped_at <= deadline_s:
            return None
        silent_s = now - self.heard_at
        silent = f"; its process sent nothing for {silent_s:.0f} s" if silent_s > 2 * BEAT_S else ""
        return (
            f"the engine core has not finished a step for {now - self.stepped_at:.0f} s "
            f"(engine_core_deadline_s={deadline_s:g}){silent}"
        )


class CoreHandle:
    """One engine core: its process (leading a process group its ranks join), the front's ends of
    its two sockets, their IPC directory, and its ``heartbeat`` once it is ready."""

    def __init__(self, context: zmq.Context, args_json: str) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="trtllm-core-")
        self.commands = context.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.SNDHWM, 0)  # (commands queue: a send never waits)
        self.outputs = context.socket(zmq.PULL)
        self.process = None
        self.info: dict = {}
        self.ready_at = 0.0
        self.heartbeat = Heartbeat(0.0, 0.0)
        try:
            commands_path, outputs_path = (f"ipc://{self.dir.name}/{n}" for n in ("in", "out"))
            self.commands.bind(commands_path)
            self.outputs.bind(outputs_path)
            process = mp.get_context("spawn").Process(
                target=core_main,
                args=(args_json, commands_path, outputs_path),
                name=f"trtllm-engine-core-{uuid.uuid4().hex[:6]}",
            )
            process.start()
            self.process = process
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, closing: threading.Event) -> bool:
        """Until the core reports ready (True) or the front shuts down (False); raises if it
        fails or exits first."""
        waited = 0.0
        while waited < READY_TIMEOUT_S and not closing.is_set():
            if self.outputs.poll(POLL_MS):
                message = decode(self.outputs.recv())
                if message["op"] == "failed":
                    raise RuntimeError(f"the engine core failed to start:\n{message['error']}")
                self.info = message["info"]
                self.ready_at = time.monotonic()
                self.heartbeat = Heartbeat(self.ready_at, self.ready_at)
                return True
            waited += POLL_S
            if (code := self.exit_code()) is not None:
                raise RuntimeError(
                    f"the engine core's process exited (code {code}) before it was ready"
                )
        if closing.is_set():
            return False
        raise RuntimeError(f"the engine core was not ready in {READY_TIMEOUT_S} s")

    def exit_code(self) -> int | None:
        """The process's exit code (minus the signal that killed it), None while it runs. The
        process is left unreaped, so its process group stays this core's to kill."""
        if self.process is None:
            return None
        try:
            ended = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # (reaped already: multiprocessing's start of another child)
            return self.process.exitcode
        if ended is None or ended.si_pid == 0:
            return None
        killed = ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        return -ended.si_status if killed else ended.si_status

    def wait_exit(self, timeout_s: float) -> None:
        if self.process is not None:
            wait([self.process.sentinel], timeout_s)

    def kill(self) -> None:
        """SIGKILL to the process group: the core, stopped or not, and its ranks."""
        process = self.process
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.kill()  # (its group not made yet)

    def stop(self) -> None:
        """Kill, reap, close the sockets and remove the IPC directory (again: nothing)."""
        self.kill()
        process, self.process = self.process, None
        if process is not None:
            process.join()
        self.commands.close(linger=0)
        self.outputs.close(linger=0)
        self.dir.cleanup()
