"""A disaggregated server's side of the step loop (``PyExecutor`` takes it in): generation-only
requests admitted by the scheduler's rule, their prompts' KV pulled between steps, and held
context-only KV freed once pulled or expired.

It works on the executor's own state: ``disagg`` (``DisaggCoordinator``), ``active``,
``seq_slots``, ``kv_cache_manager``, ``rank_sync``, ``lockstep``, ``guided``, ``stats``,
``max_seq_len``, and its ``check_request`` and ``_release``."""

from __future__ import annotations

from collections.abc import Callable

from tensorrt_llm._torch.disaggregation.coordinator import LoadKv
from tensorrt_llm._torch.pyexecutor.launched_step import check_stop
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.scheduler import admit, owed_to_admitted


class DisaggAdmission:
    def release_transferred(
        self,
        request_ids: list[int] | None = None,
        revoke: Callable[[int], None] | None = None,
        expire: bool = True,
    ) -> int:
        """Free context-only requests that were pulled (``request_ids``) or (``expire``) waited
        past the transfer timeout, calling ``revoke(request_id)`` before each one's slots are
        freed. Returns how many were freed."""
        done = self.disagg.due(request_ids or (), expire)
        if done and self.rank_sync is not None:
            self.rank_sync.released(done)
        self.disagg.free(done, revoke)
        return len(done)

    def enqueue_generation_only(self, request: LlmRequest, load_kv: LoadKv) -> None:
        """Start a request at its first generation step (its first token and drafts from the
        context server): admitted by the scheduler's rule, its prompt's KV then pulled by
        ``load_kv`` between steps (``DisaggCoordinator``), it joins the batch once loaded."""
        try:
            self.check_request(request)  # it joins ``active`` once admitted
            if self.guided is not None and self.lockstep:  # (ranks in step schedule alike)
                self.guided.submit_now(request)
            elif self.guided is not None:  # (compiled while its KV is pulled)
                self.guided.submit(request, beside=True)
        except ValueError:
            load_kv.abandon()
            raise
        self.disagg.wait(request, load_kv)
        if self.rank_sync is not None:
            self.rank_sync.submitted_generation_only(request, load_kv.handle)
        if self.lockstep:
            return  # admitted in the next step, on every rank
        self._admit_generation_only()
        if request.finish_reason is FinishReason.ERROR:
            raise ValueError(str(request.stop_reason))

    def _admit_generation_only(self) -> None:
        """Start the loads that fit, and advance those in flight (never waiting on one)."""
        if self.disagg.waiting:
            owed = owed_to_admitted(self.kv_cache_manager, self.active, self.seq_slots)
            self.disagg.admit(owed, self.seq_slots, self._begin_load)
        if self.disagg.loading or self.disagg.draining:
            self.disagg.progress(self._start_generation, self._release)

    def _begin_load(self, request: LlmRequest) -> None:  # its KV is reserved while it loads
        request.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
        admit(request, self.seq_slots)
        self.active.append(request)

    def _start_generation(self, request: LlmRequest, num_loaded_tokens: int) -> None:
        """A generation-only request whose prompt KV is loaded joins the batch."""
        self.stats.num_transferred_tokens += num_loaded_tokens
        request.context_current_position = request.prompt_len
        request.state = LlmRequestState.GENERATION_IN_PROGRESS
        check_stop(request, request.output_token_ids[-1], self.max_seq_len)  # the first may end it
        if request.is_finished:
            self._release(request)
        elif self.guided is not None:
            self.guided.hold(request)  # (until its grammar is ready)
