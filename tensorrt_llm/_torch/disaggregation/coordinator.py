"""DisaggCoordinator: a server's disaggregated-serving state, beside the executor's step.

- **Context side.** A context-only request that finished its prefill (``FinishReason.CONTEXT_DONE``)
  keeps its slots (``held``) until a generation server has pulled them or the transfer timeout
  passes; ``due`` names those to free, ``free`` frees them.
- **Generation side.** A request resumed from a context server waits (``waiting``), in arrival
  order, until the KV it needs to completion fits beside what the admitted requests are owed; then
  it is admitted and its ``load_kv`` pulls the prompt's KV (``loading``), advanced once between
  steps (``progress``) and never waited for: a frozen context server holds up its own requests
  only, until the transfer timeout fails them. Once its KV is in, a request joins the batch.

The executor calls it at fixed points of its step: ``admit`` and ``progress`` before scheduling, ``hold`` instead
of freeing a finished context-only request, ``announce_holds`` after the step (the ranks' hook,
``disaggregation/parallel.py``). The executor keeps the step and the requests; this object keeps
only what waits on another server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tensorrt_llm._torch.disaggregation import DEFAULT_TRANSFER_TIMEOUT_S
from tensorrt_llm._torch.disaggregation.pulls import ReplayedHandleError
from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, FinishReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm.logger import logger

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.seq_slot_manager import SeqSlotManager


class LoadKv(Protocol):
    """A generation-only request's prompt KV (``generation_only.PromptKvPull``)."""

    def steps(self, request: LlmRequest) -> Generator[None, None, int]:
        """Allocate the prompt's slots and fill them, yielding while transfers are in flight;
        returns the prompt tokens it did not compute. Raises if the KV cannot come."""

    def abandon(self) -> None:
        """The load will not run (again): let the context server free what it holds for it."""

    def settled(self, request: LlmRequest) -> bool:
        """Whether nothing of a given-up load still writes into ``request``'s slots."""


@dataclass
class _Loading:
    request: LlmRequest
    load_kv: LoadKv
    steps: Generator[None, None, int]


@dataclass
class _Held:
    request: LlmRequest
    deadline: float  # time.monotonic() past which its KV is freed unpulled


class DisaggCoordinator:
    def __init__(
        self,
        resource_manager: ResourceManager,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        on_hold: Callable[[list[int]], None] | None = None,
    ) -> None:
        """``on_hold``: called once per step with the context-only requests whose KV started
        waiting for a pull (``disaggregation/parallel.py``: ``hold_in_step``)."""
        self.resource_manager = resource_manager
        self.transfer_timeout_s = transfer_timeout_s  # how long held KV waits for a pull
        self.held: dict[int, _Held] = {}
        self.waiting: list[tuple[LlmRequest, LoadKv]] = []
        self.loading: dict[int, _Loading] = {}  # admitted, their KV in flight (arrival order)
        # ended while a READ into their slots could not be cancelled: freed once it ends
        self.draining: dict[int, tuple[LlmRequest, LoadKv]] = {}
        self.on_hold = on_hold

    def _kv(self):
        return self.resource_manager.get_resource_manager(ResourceManagerType.KV_CACHE_MANAGER)

    # ---- context side ---------------------------------------------------------------------------
    def hold(self, request: LlmRequest) -> None:
        """Keep a finished context-only request's slots for a generation server's pull."""
        self.held[request.request_id] = _Held(request, time.monotonic() + self.transfer_timeout_s)

    def announce_holds(self, finished: Iterable[LlmRequest]) -> None:
        held = [r.request_id for r in finished if r.finish_reason is FinishReason.CONTEXT_DONE]
        if held and self.on_hold is not None:
            self.on_hold(held)

    def due(self, pulled: Iterable[int] = (), expire: bool = True) -> list[int]:
        """The held requests to free: those ``pulled``, and (``expire``) those past their
        deadline."""
        now, pulled = time.monotonic(), set(pulled)
        return [
            rid
            for rid, held in self.held.items()
            if rid in pulled or expire and held.deadline < now
        ]

    def free(self, request_ids: list[int], revoke: Callable[[int], None] | None = None) -> None:
        """Free held requests, calling ``revoke(request_id)`` before each one's slots go."""
        for rid in request_ids:
            held = self.held.pop(rid)
            if revoke is not None:
                revoke(rid)
            self.resource_manager.free_resources(held.request)

    def held_slots(self) -> int:
        """KV slots held for pulls that have not come."""
        kv = self._kv()
        return sum(kv.get_cache(rid).num_blocks for rid in self.held)

    def hold_left_s(self, request_id: int) -> float:
        """Seconds until a held request's KV is freed unpulled (0 if it is not held)."""
        held = self.held.get(request_id)
        return max(0.0, held.deadline - time.monotonic()) if held is not None else 0.0

    # ---- generation side ------------------------------------------------------------------------
    def wait(self, request: LlmRequest, load_kv: LoadKv) -> None:
        self.waiting.append((request, load_kv))

    def admit(
        self, owed: int, seq_slots: SeqSlotManager, begin: Callable[[LlmRequest], None]
    ) -> None:
        """Start loading the waiting requests that fit, in arrival order (none overtakes
        another), with ``owed`` KV slots already promised to the admitted requests and while a
        request slot is free (``seq_slots``); ``begin`` hands each to the executor, which admits
        it (its KV is reserved and its request slot held from here on)."""
        kv = self._kv()
        while self.waiting:
            request, load_kv = self.waiting[0]
            need = kv.get_needed_resource_to_completion(request)
            if owed + need > kv.get_num_free_blocks() or not seq_slots.num_free:
                return
            self.waiting.pop(0)
            begin(request)
            self.loading[request.request_id] = _Loading(request, load_kv, load_kv.steps(request))
            owed += need

    def progress(
        self, done: Callable[[LlmRequest, int], None], failed: Callable[[LlmRequest], None]
    ) -> None:
        """Advance every load once, between steps and in admission order (the same on every
        rank); none is waited for. ``done(request, num_loaded_tokens)`` for each whose KV is in;
        one that failed (or timed out) is given its error, then ``failed(request)`` frees it.
        The others go on."""
        for request_id, loading in list(self.loading.items()):
            try:
                next(loading.steps)
                continue
            except StopIteration as end:
                loaded = end.value
            except Exception as exc:  # this request ends (``drop_loading``); the others go on
                logger.warning("request %d: its KV did not load: %s", request_id, exc)
                if isinstance(exc, ReplayedHandleError):  # the request's fault, not a transfer's
                    loading.request.fail(ErrorKind.INVALID_REQUEST, str(exc))
                else:
                    loading.request.fail(
                        ErrorKind.KV_TRANSFER,
                        f"its prompt's KV could not be pulled from the context server: {exc}",
                    )
                failed(loading.request)
                continue
            del self.loading[request_id]
            done(loading.request, loaded)
        self.drain()

    def drop_loading(self, request_id: int) -> bool:
        """A request that ended while its KV was in flight: its transfers are given up and the
        context server is told. True when a READ into its slots could not be cancelled: the
        executor leaves them, and ``drain`` frees them once it has ended."""
        loading = self.loading.pop(request_id, None)
        if loading is None:
            return False
        loading.steps.close()
        loading.load_kv.abandon()
        if loading.load_kv.settled(loading.request):
            return False
        self.draining[request_id] = (loading.request, loading.load_kv)
        return True

    def drain(self) -> None:
        """Free the slots of ended requests whose last READ has ended since."""
        for request_id, (request, load_kv) in list(self.draining.items()):
            if load_kv.settled(request):
                del self.draining[request_id]
                self.resource_manager.free_resources(request)

    def cancel_waiting(self, request_id: int, reason: FinishReason) -> LlmRequest | None:
        """End a waiting request (its KV never loaded); None if it is not waiting."""
        for i, (request, load_kv) in enumerate(self.waiting):
            if request.request_id == request_id:
                del self.waiting[i]
                load_kv.abandon()
                request.finish(reason)
                return request
        return None

    def end_waiting(self, reason: FinishReason, stop_reason=None) -> None:
        for request, load_kv in self.waiting:
            load_kv.abandon()
            request.finish(reason, stop_reason)
        self.waiting.clear()
