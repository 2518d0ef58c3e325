"""PyExecutor: the step loop (schedule -> prepare -> forward -> sample -> update -> free)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tensorrt_llm._torch.disaggregation.coordinator import DisaggCoordinator, LoadKv, abandon
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.logits_processing import process_logits
from tensorrt_llm._torch.pyexecutor.model_engine import ForwardOutput, PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.sampler import SamplingTensors, sample, token_logprobs
from tensorrt_llm._torch.pyexecutor.scheduler import (
    GuaranteedNoEvictScheduler,
    ScheduledRequests,
    admit,
    owed_to_admitted,
)
from tensorrt_llm._torch.speculative.interface import StepTokens

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner
    from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker


@dataclass
class ExecutorStats:
    num_steps: int = 0
    num_context_tokens_computed: int = 0  # prompt tokens that went through a forward
    num_reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead
    num_generated_tokens: int = 0
    num_decode_iterations: int = 0
    num_accepted_draft_tokens: int = 0
    num_transferred_tokens: int = 0  # prompt tokens whose KV a generation-only request pulled

    @property
    def avg_decoded_tokens_per_iter(self) -> float | None:
        """Iteration-weighted acceptance length over every request so far."""
        if not self.num_decode_iterations:
            return None
        return 1.0 + self.num_accepted_draft_tokens / self.num_decode_iterations


class RankSync(Protocol):
    """What rank 0's executor tells the other ranks under tensor parallelism
    (``distributed/ranks.py``: ``TensorParallelLeader``)."""

    def submitted(self, request: LlmRequest) -> None: ...

    def submitted_generation_only(self, request: LlmRequest, handle) -> None: ...

    def cancelled(self, request_id: int) -> None: ...

    def released(self, request_ids: list[int]) -> None: ...

    def start_step(self) -> None: ...


class PyExecutor:
    def __init__(
        self,
        model_engine: PyTorchModelEngine,
        resource_manager: ResourceManager,
        scheduler: GuaranteedNoEvictScheduler,
        max_seq_len: int,
        spec_worker: Eagle3OneModelWorker | None = None,
        cuda_graph_runner: CUDAGraphRunner | None = None,
    ) -> None:
        self.spec_worker = spec_worker
        self.cuda_graph_runner = cuda_graph_runner
        self.model_engine = model_engine
        self.resource_manager = resource_manager
        self.scheduler = scheduler
        self.max_seq_len = max_seq_len
        self.active: list[LlmRequest] = []
        # held context-only KV, and generation-only requests waiting for theirs
        self.disagg = DisaggCoordinator(resource_manager)
        self._admitted: set[int] = set()
        self.stats = ExecutorStats()
        # Rank 0 under tensor parallelism: told of every submit, cancel and release, and called
        # at the start of every step to send them to the other ranks (``distributed/ranks.py``).
        self.rank_sync: RankSync | None = None
        # Every rank under tensor parallelism: generation-only requests are admitted (and pull
        # their KV) inside a step only, at the same point on every rank.
        self.lockstep = False

    @property
    def kv_cache_manager(self):
        return self.resource_manager.get_resource_manager(ResourceManagerType.KV_CACHE_MANAGER)

    @property
    def has_work(self) -> bool:
        return bool(self.active or self.disagg.waiting)

    def enqueue_request(self, request: LlmRequest) -> None:
        self.check_request(request)
        self.active.append(request)
        if self.rank_sync is not None:
            self.rank_sync.submitted(request)

    def check_request(self, request: LlmRequest) -> None:
        """Raise ``ValueError`` if ``request`` can never run here (its prompt, or its KV)."""
        if request.prompt_len == 0:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if request.prompt_len >= self.max_seq_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.prompt_len} tokens leaves no room to "
                f"generate within max_seq_len={self.max_seq_len}"
            )
        kv = self.kv_cache_manager
        need, total = kv.get_needed_resource_to_completion(request), kv.get_max_resource_count()
        if need > total:
            raise ValueError(
                f"request {request.request_id} needs {need} KV slots to complete but the cache has {total}; "
                f"raise kv_cache_config.max_tokens or lower max_tokens"
            )

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
        """Start a request at its first generation step: its prompt's KV comes from ``load_kv``
        (which allocates and fills the slots, and returns the prompt tokens it did not compute), its
        first token and drafts from the context server. No prefill runs here.

        Admission is the scheduler's rule for a new prompt: the request waits, in arrival order,
        until the KV it needs to completion fits beside what the admitted requests are owed; only
        then does ``load_kv`` run. A request that fails to load ends with ``FinishReason.ERROR``
        (raised here when it fails at once). A request refused, cancelled or failed before its KV
        is loaded calls ``load_kv.abandon()`` when ``load_kv`` has one (so the context server can
        free what it holds for the load now, not at its timeout)."""
        try:
            self.check_request(request)  # it joins ``active`` once admitted
        except ValueError:
            abandon(load_kv)
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
        if self.disagg.waiting:
            owed = owed_to_admitted(self.kv_cache_manager, self.active, self._admitted)
            self.disagg.admit(owed, self._start_generation)

    def _start_generation(self, request: LlmRequest, num_loaded_tokens: int) -> None:
        """A generation-only request whose prompt KV is loaded joins the batch."""
        self.stats.num_transferred_tokens += num_loaded_tokens
        request.context_current_position = request.prompt_len
        request.state = LlmRequestState.GENERATION_IN_PROGRESS
        admit(request, self._admitted)
        self.active.append(request)
        self._check_stop(request, request.output_token_ids[-1])  # the first token may end it
        if request.is_finished:
            self._release(request)

    def step(self) -> list[LlmRequest]:
        """Run one iteration; returns the requests that finished in it (already freed)."""
        if self.rank_sync is not None:
            try:
                self.rank_sync.start_step()
            except Exception:  # another rank is gone: no request can go on
                self.end_all(FinishReason.ERROR)
                raise
        self._admit_generation_only()
        batch = self.scheduler.schedule(self.active, self._admitted)
        if batch.batch_size == 0:
            return []
        try:
            self.resource_manager.prepare_resources(batch)
            for req in batch.context_requests:
                if req.request_id in batch.reused_tokens:
                    req.skip_reused_prefix(batch.reused_tokens[req.request_id])
                    self.stats.num_reused_tokens += req.num_reused_tokens
            self._forward_and_update(batch)
            self.resource_manager.update_resources(batch)
        except Exception:
            for req in batch.all_requests:  # never leak a slot: the batch's requests end here
                req.finish(FinishReason.ERROR)
                self._release(req)
            raise
        self.stats.num_steps += 1
        self.stats.num_context_tokens_computed = self.model_engine.num_context_tokens_computed
        finished = [r for r in batch.all_requests if r.is_finished]
        for req in finished:
            self._release(req)
        self.disagg.announce_holds(finished)
        return finished

    def end_all(self, reason: FinishReason) -> None:
        """Finish every request, active or waiting for its KV, with ``reason``, and free it."""
        self.disagg.end_waiting(reason)
        for req in list(self.active):
            req.finish(reason)
            self._release(req)

    def shutdown(self) -> None:
        """Drop the CUDA graphs and free the KV cache."""
        if self.cuda_graph_runner is not None:
            self.cuda_graph_runner.release()
        self.resource_manager.shutdown()

    def _release(self, req: LlmRequest) -> None:
        if req.finish_reason is FinishReason.CONTEXT_DONE:  # its KV waits for a generation server
            self.disagg.hold(req)
        else:
            self.resource_manager.free_resources(req)
        self._admitted.discard(req.request_id)
        if req in self.active:
            self.active.remove(req)

    def _sample(self, batch: ScheduledRequests, output: ForwardOutput) -> StepTokens:
        """Target-only decoding: one token per request that produced logits, drawn on the
        device for the whole batch (``sampler.sample``), one copy to the host."""
        requests = batch.all_requests
        sampled = [i for i, n in enumerate(output.num_logits) if n]
        st = SamplingTensors.of([requests[i] for i in sampled], output.logits.device)
        tokens = sample(output.logits, st)
        new_tokens: list[list[int]] = [[] for _ in requests]
        for i, token in zip(sampled, tokens.tolist(), strict=True):
            new_tokens[i] = [token]
        return StepTokens(new_tokens, [[] for _ in requests], [None] * len(requests))

    def _forward_and_update(self, batch: ScheduledRequests) -> None:
        """One forward (a CUDA graph replay when the runner takes the batch), then the tokens."""
        runner = self.cuda_graph_runner
        bucket = runner.bucket_size(batch) if runner is not None else None
        if bucket is not None:
            graph_step = runner.run(batch, bucket)
            logits, num_logits, step = graph_step.logits, graph_step.num_logits, graph_step.tokens
        else:
            output = self.model_engine.forward(batch)
            logits, num_logits = output.logits, output.num_logits
            if any(r.sampling_params.processes_logits for r in batch.all_requests):
                process_logits(batch.all_requests, logits, num_logits)
            step = (
                self.spec_worker.run(batch, output)
                if self.spec_worker
                else self._sample(batch, output)
            )
        self._update_requests(batch, logits, num_logits, step)

    def _update_requests(
        self,
        batch: ScheduledRequests,
        logits: torch.Tensor,
        num_logits: list[int],
        step: StepTokens,
    ) -> None:
        row = 0
        for i, req in enumerate(batch.all_requests):
            rows = logits[row : row + num_logits[i]]
            row += num_logits[i]
            if req.is_context_init_state:
                req.context_current_position += req.context_chunk_size
            tokens = step.new_tokens[i]
            if not tokens:
                continue
            decoding = req.state is LlmRequestState.GENERATION_IN_PROGRESS
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            req.num_sampling_steps += 1  # the next step's random numbers are new
            emitted, top = 0, req.sampling_params.logprobs
            logprobs = token_logprobs(rows[: len(tokens)], tokens, top) if top is not None else None
            for j, token in enumerate(tokens):
                if req.sampling_params.return_generation_logits:
                    req.py_generation_logits.append(rows[j].cpu())
                if logprobs is not None:
                    req.py_logprobs.append(logprobs[j])
                req.output_token_ids.append(token)
                emitted += 1
                self.stats.num_generated_tokens += 1
                self._check_stop(req, token)
                if req.is_finished:
                    break
            if decoding:  # AL counts the accepted drafts that were emitted, not those cut off
                accepted = min(step.num_accepted[i] or 0, emitted - 1)
                req.num_decode_iterations += 1
                req.num_accepted_draft_tokens += accepted
                self.stats.num_decode_iterations += 1
                self.stats.num_accepted_draft_tokens += accepted
            req.py_draft_tokens = [] if req.is_finished else step.next_drafts[i]
            if req.context_only and not req.is_finished:
                req.finish(FinishReason.CONTEXT_DONE)

    def _check_stop(self, req: LlmRequest, token: int) -> None:
        """The token-level ends: an end or stop token, the length. Stop strings are the output
        side's (the detokenizer, above this package), which ends a request through
        ``finish_request``."""
        params = req.sampling_params
        if token in req.end_ids and not params.ignore_eos or token in params.stop_token_ids:
            req.finish(FinishReason.STOP, token)
        elif (
            len(req.output_token_ids) >= req.max_new_tokens
            or req.get_num_tokens() >= self.max_seq_len
        ):
            req.finish(FinishReason.LENGTH)
