"""PyExecutor: the step loop (schedule -> prepare -> forward -> sample -> update -> free)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorrt_llm._torch.disaggregation.coordinator import DisaggCoordinator
from tensorrt_llm._torch.pyexecutor import executor as protocol
from tensorrt_llm._torch.pyexecutor.disagg_admission import DisaggAdmission
from tensorrt_llm._torch.pyexecutor.executor import ExecutorStats, RankSync
from tensorrt_llm._torch.pyexecutor.fault_isolation import FaultIsolation, describe
from tensorrt_llm._torch.pyexecutor.launched_step import LaunchedStep, LaunchingBatch, apply_tokens
from tensorrt_llm._torch.pyexecutor.llm_request import (
    ErrorKind,
    FinishReason,
    LlmRequest,
    LlmRequestState,
    RequestError,
)
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.scheduler import (
    GuaranteedNoEvictScheduler,
    ScheduledRequests,
    check_fits,
)
from tensorrt_llm._torch.pyexecutor.step_dispatch import StepDispatch
from tensorrt_llm.logger import logger

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
    from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner
    from tensorrt_llm._torch.pyexecutor.guided_decoder import GuidedDecoder
    from tensorrt_llm._torch.pyexecutor.seq_slot_manager import SeqSlotManager
    from tensorrt_llm._torch.pyexecutor.step_plan import StepPlan
    from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker


class PyExecutor(DisaggAdmission):
    def __init__(
        self,
        model_engine: PyTorchModelEngine,
        resource_manager: ResourceManager,
        scheduler: GuaranteedNoEvictScheduler,
        max_seq_len: int,
        spec_worker: Eagle3OneModelWorker | None = None,
        cuda_graph_runner: CUDAGraphRunner | None = None,
        overlap: bool = False,
        disagg: DisaggCoordinator | None = None,
        transceiver: KvCacheTransceiver | None = None,
        rank_sync: RankSync | None = None,
        lockstep: bool = False,
        guided: GuidedDecoder | None = None,
    ) -> None:
        """``disagg``: held KV and requests pulling theirs (a disaggregated server's, with its
        ``transceiver``); ``rank_sync``: rank 0's under tensor parallelism, telling the other
        ranks of every submit, cancel and release at the start of every step
        (``executors/ranks.py``); ``lockstep``: every rank under tensor parallelism, where
        generation-only requests are admitted (and pull their KV) inside a step only, at the same
        point on every rank. ``guided``: the requests' grammars (guided decoding)."""
        self.spec_worker = spec_worker
        self.guided = guided
        # The overlap scheduler: step n+1 is launched before step n is read (``step``).
        self.overlap = overlap
        self._unread: list[LaunchedStep] = []  # launched steps not yet read, oldest first
        self.model_engine = model_engine
        self.resource_manager = resource_manager
        self.scheduler = scheduler
        self.max_seq_len = max_seq_len
        self.dispatch = StepDispatch(
            model_engine, resource_manager, spec_worker, cuda_graph_runner, overlap, guided
        )
        self.active: list[LlmRequest] = []
        self.disagg = disagg or DisaggCoordinator(resource_manager)
        self.transceiver = transceiver
        self.seq_slots: SeqSlotManager = resource_manager.get_resource_manager(
            ResourceManagerType.SEQ_SLOT_MANAGER
        )  # one slot per admitted request
        self.stats = ExecutorStats()
        self.isolation = FaultIsolation()  # a failed step's requests retried one at a time
        self.rank_sync = rank_sync
        self.lockstep = lockstep
        self._alone = False  # (``run_alone``)
        self._launching: LaunchingBatch | None = None  # (``_launch``)

    @property
    def cuda_graph_runner(self) -> CUDAGraphRunner | None:
        return self.dispatch.runner

    @property
    def kv_cache_manager(self):
        return self.resource_manager.get_resource_manager(ResourceManagerType.KV_CACHE_MANAGER)

    @property
    def has_work(self) -> bool:
        return bool(self.active or self.disagg.waiting or self.disagg.draining or self._unread)

    def enqueue_request(self, request: LlmRequest) -> None:
        self.check_request(request)
        if self.guided is not None:
            if self.lockstep or self.rank_sync is not None:  # (ranks in step schedule alike)
                self.guided.submit_now(request)
            else:
                self.guided.submit(request)  # (it waits in the queue)
        self.active.append(request)
        if self.rank_sync is not None:
            self.rank_sync.submitted(request)

    def check_request(self, request: LlmRequest) -> None:
        """``ValueError`` if ``request`` can never run here (its prompt, KV or grammar)."""
        check_fits(request, self.kv_cache_manager, self.max_seq_len)
        if request.sampling_params.guided_decoding is not None and self.guided is None:
            raise ValueError("guided_decoding needs LLM(guided_decoding_backend='xgrammar')")

    def cancel_request(self, request_id: int) -> bool:
        """Finish a request now and free its KV. Returns False if it is not active or waiting."""
        return self.finish_request(request_id, FinishReason.CANCELLED)

    def finish_request(
        self, request_id: int, reason: FinishReason, stop_reason: int | str | None = None
    ) -> bool:
        """End a request with ``reason`` between steps and free its KV (the other ranks cancel
        their copy). Returns False if it is not active or waiting."""
        request = self.disagg.cancel_waiting(request_id, reason)
        if request is None:
            request = next((r for r in self.active if r.request_id == request_id), None)
            if request is None:
                return False
            request.finish(reason, stop_reason)
            self._release(request)
        if self.rank_sync is not None:
            self.rank_sync.cancelled(request_id)
        return True

    def step(self) -> list[LlmRequest]:
        """Run one iteration; returns the requests that finished in it (already freed).

        Without the overlap: schedule, launch, read. With it, the step launched last time is read
        only after this one is launched, so the host's scheduling and preparing run while the
        device computes. The requests that go on take their inputs from the launched step's
        tokens on the device (``batch.feed``); a stop lands one step late, its extra token never
        emitted, and the request's KV is freed once the step that still writes it is read. The
        launched step is read first when this batch cannot be fed from the device (Eagle3 outside
        the CUDA graphs, whose positions the host computes)."""
        if self.rank_sync is not None:
            try:
                self.rank_sync.start_step()
            except Exception as exc:  # another rank is gone: no request can go on
                self.end_all(RequestError(ErrorKind.RANK_LOST, f"a rank is gone ({describe(exc)})"))
                raise
        self._admit_generation_only()
        for req in self.guided.poll() if self.guided is not None else ():
            self._release(req)  # (its grammar could not be built)
        batch = self.scheduler.schedule(self.active, self.seq_slots, not self._alone)
        finished: list[LlmRequest] = []
        if self._unread and batch.batch_size:
            batch.feed = self._unread[-1].feed()
            batch.hold_back_at_length(self.max_seq_len)
        self.isolation.restrict(batch)
        plan = self.dispatch.plan(batch)  # (the ranks agree on the MoE exchanges here)
        if batch.feed is not None and not plan.idle and not self.dispatch.can_feed(plan):
            finished += self._read(self._unread[-1])
            batch.feed = None
            batch.pause([r for r in batch.all_requests if r.is_finished])
            plan = self.dispatch.plan(batch, agreed=plan)
        launched = not plan.idle
        if launched:  # (a fed request's grammar reads the steps before between its two parts)
            self._launch(plan, lambda: finished.extend(self._settle()))
        else:
            self.take_part(plan)
        while self._unread and (
            not launched  # nothing runs behind it: nothing to overlap
            or len(self._unread) > 1
            or not self._unread[0].overlappable
            or self._unread[0].all_finished
        ):
            finished += self._read(self._unread[0])
        return finished

    def run_alone(self, requests: list[LlmRequest], max_steps: int) -> int:
        """Run ``requests`` on this rank alone, one more joining each step, until they end or
        ``max_steps`` steps ran; returns the steps. (The start-up warm-up: every rank runs the
        same requests in the same order, so no rank commands are sent.)"""
        rank_sync, self.rank_sync = self.rank_sync, None
        self._alone = True  # (each prompt prefills in the step it joins: no batch waiting)
        steps = 0
        try:
            for request in requests:
                self.enqueue_request(request)
                self.step()
                steps += 1
            while self.has_work and steps < max_steps:
                self.step()
                steps += 1
        finally:
            self.rank_sync, self._alone = rank_sync, False
        return steps

    def reset_stats(self) -> None:
        """The statistics start again from zero (after the start-up warm-up)."""
        self.stats = ExecutorStats()

    @property
    def limits(self) -> protocol.ExecutorLimits:
        return protocol.limits_of(self)

    def snapshot(self, check_integrity: bool = False) -> protocol.ExecutorSnapshot:
        return protocol.snapshot_of(self, check_integrity)

    def expert_tokens(self) -> list[int] | None:
        counts = self.model_engine.expert_tokens()  # (TP attention: every rank routes every token)
        return None if counts is None else counts.tolist()

    def take_part(self, plan: StepPlan) -> None:
        """Nothing to run here: where the MoE layers exchange tokens, take part all the same."""
        if self.model_engine.exchange is not None:
            self.model_engine.exchange.idle_step(plan.moe_capacity)
            self.stats.num_idle_steps += 1

    def _launch(self, plan: StepPlan, settle: Callable[[], object]) -> None:
        """Prepare the batch's KV and queue its step (``settle``: reads the steps before, when its
        grammars' masks need their tokens). On failure (after what is already launched is read)
        its requests run again one at a time, or end (``fault_isolation.py``)."""
        batch = plan.batch
        forwarded = False
        self._launching = launching = LaunchingBatch(batch)
        try:
            self.resource_manager.prepare_resources(batch)
            replan = bool(batch.paused_requests)  # (some found no KV)
            for req in batch.context_requests:
                if req.request_id in batch.reused_tokens:
                    req.skip_reused_prefix(batch.reused_tokens[req.request_id])
                    replan = True  # (a prompt's chunk shrank: a mixed graph may take it)
            if replan:  # the bucket follows the batch left
                plan = self.dispatch.plan(batch, agreed=plan)
            forwarded, overlapped = True, bool(self._unread)  # (launched before one was read)
            step = self.dispatch.launch(plan, settle)
            step.deferred += launching.deferred
            self._unread.append(step)
        except Exception as exc:  # its requests end (never leaking a slot) or run again alone
            one_rank = self.rank_sync is None and not self.lockstep  # (an ADP rank runs alone
            one_rank &= self.model_engine.exchange is None  # unless its MoE meets the others)
            ended = self.isolation.failed(batch, exc, retry=one_rank)
            for req in ended:
                self._release(req)
            self._drain()
            for req in launching.deferred:  # (nothing of this step runs on)
                self._free(req)
            if not forwarded:
                self.take_part(plan)
            if ended:
                raise
            return
        finally:
            self._launching = None
        self.isolation.passed(batch)
        self.stats.num_steps += 1
        self.stats.num_reused_tokens += sum(
            r.num_reused_tokens
            for r in batch.context_requests
            if r.request_id in batch.reused_tokens
        )
        self.stats.num_overlapped_steps += overlapped
        if plan.bucket is not None:
            self.stats.num_graph_steps += 1
            self.stats.num_mixed_graph_steps += plan.bucket.prompt_tokens > 0
        self.stats.num_context_tokens_computed = self.model_engine.num_context_tokens_computed
        made = set(self._unread[-1].device_tokens.rows)  # the requests that make a token
        for i, req in enumerate(batch.all_requests):
            if req.is_context_init_state:  # what the host knows of the step before it runs
                req.context_current_position += req.context_chunk_size
            if i in made:
                req.num_sampling_steps += 1  # the next step's random numbers are new
                if not req.context_only and not req.is_finished:  # (ended while it launched)
                    req.state = LlmRequestState.GENERATION_IN_PROGRESS

    def _read(self, step: LaunchedStep) -> list[LlmRequest]:
        """Bring a launched step's tokens to its requests; returns those that finished. Requests
        ended before the read are skipped; on failure the step's requests end."""
        try:
            live = [r for r in step.batch.all_requests if not r.is_finished]
            try:
                apply_tokens(step, step.read(), live, self.stats, self.max_seq_len)
                later = self._unread[self._unread.index(step) + 1 :]
                later += [self._launching] if self._launching is not None else []
                done = ScheduledRequests(
                    [r for r in step.batch.context_requests if r in live],
                    [r for r in step.batch.generation_requests if r in live],
                    keep_capacity={r.request_id for s in later for r in s.batch.all_requests},
                )
                self.resource_manager.update_resources(done)
            except Exception as exc:
                for req in live:  # their KV is freed once the steps still holding them are read
                    if not req.is_finished:
                        req.fail(
                            ErrorKind.ENGINE_FAULT, f"reading its step failed ({describe(exc)})"
                        )
                    if req in self.active:
                        self._release(req)
                raise
            finished = [r for r in live if r.is_finished]
            for req in finished:
                self._release(req)
            self.disagg.announce_holds(finished)
            return finished
        finally:
            self._unread.remove(step)
            for req in step.deferred:
                self._free(req)

    def _settle(self) -> list[LlmRequest]:
        """Read every launched step (a step being launched needs their tokens); returns the
        requests that finished."""
        finished = []
        while self._unread:
            finished += self._read(self._unread[0])
        return finished

    def _drain(self) -> None:
        """Read every launched step (a failure is logged: its requests have ended)."""
        while self._unread:
            try:
                self._read(self._unread[0])
            except Exception:
                logger.error("reading a launched step failed:\n%s", traceback.format_exc())

    def end_all(self, error: RequestError) -> None:
        """End every request, active or waiting for its KV, with ``error``, and free it."""
        self.disagg.end_waiting(FinishReason.ERROR, error)
        for req in list(self.active):
            req.finish(FinishReason.ERROR, error)
            self._release(req)
        self._drain()

    def shutdown(self) -> None:
        """Drop the CUDA graphs and free the KV cache."""
        self._drain()
        if self.cuda_graph_runner is not None:
            self.cuda_graph_runner.release()
        if self.guided is not None:
            self.guided.compiler.shutdown()
        self.resource_manager.shutdown()

    def _release(self, req: LlmRequest) -> None:
        """A finished request leaves the batch; its KV is freed now, or once the last launched
        step that still holds it is read."""
        holder = next((s for s in reversed(self._unread) if s.holds(req)), None)
        if self._launching is not None and self._launching.holds(req):
            holder = self._launching
        if holder is not None:
            holder.deferred.append(req)
        else:
            self._free(req)
        self.seq_slots.release(req)
        self.isolation.forget(req)
        if self.guided is not None:
            self.guided.forget(req)
        if req in self.active:
            self.active.remove(req)

    def _free(self, req: LlmRequest) -> None:
        if req.finish_reason is FinishReason.CONTEXT_DONE:  # its KV waits for a generation server
            self.disagg.hold(req)
        elif not self.disagg.drop_loading(req.request_id):  # (a READ into it may still run)
            self.resource_manager.free_resources(req)
