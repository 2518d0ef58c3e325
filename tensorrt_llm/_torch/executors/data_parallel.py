"""Attention data parallelism: each rank runs its own requests with its own executor and KV cache
(the unified draft cache on every rank); rank 0 spreads the requests and collects what the other
ranks produce.

Rank 0's ``AttentionDpExecutor`` is what the LLM and the server drive, with the executor interface
they use (``enqueue_request``, ``cancel_request``, ``step``, ``has_work``, ``active``, ``stats``).
A request goes to the rank that took the longest prefix of its prompt before (``affinity.py``:
prefix reuse is per rank, so a conversation's turns stay together) unless that rank has half a
batch more unfinished requests than the least loaded one; otherwise to the least loaded rank. A
request on another rank is mirrored on rank 0 by a shadow ``LlmRequest`` that each step's reports
bring up to date, so callers read every request the same way. Every step is one broadcast of the
commands and one gather of the reports over the control group. With the experts replicated
(one rank) the ranks' forwards share no collective; with expert parallelism the MoE layers
exchange tokens (``moe_all_to_all.py``), so every rank takes part in every step, a rank with
nothing to run in the exchanges alone (``PyExecutor.take_part``, ``moe_all_to_all.ExchangeSync``).

"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable

import torch

from tensorrt_llm._torch.distributed.communicator import gather_json
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.executors.affinity import PrefixAffinity, choose_rank
from tensorrt_llm._torch.executors.commands import CancelCommand, RankCommand
from tensorrt_llm._torch.executors.ranks import (
    generation_only_command,
    send_step_commands,
    submit_command,
)
from tensorrt_llm._torch.pyexecutor.executor import ExecutorLimits, ExecutorSnapshot, ExecutorStats
from tensorrt_llm._torch.pyexecutor.fault_isolation import describe
from tensorrt_llm._torch.pyexecutor.llm_request import (
    ErrorKind,
    FinishReason,
    LlmRequest,
    LlmRequestState,
    RequestError,
    stop_reason_from_json,
    stop_reason_to_json,
)
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm.logger import logger
from tensorrt_llm.runtime.staging import DeviceReadback


@dataclasses.dataclass
class _Remote:
    rank: int
    request: LlmRequest  # the shadow rank 0 hands out


class AttentionDpExecutor:
    def __init__(self, local: PyExecutor, mapping: Mapping, lost: Callable[[], str | None]) -> None:
        self.local = local  # rank 0's own executor
        self.mapping = mapping
        self._lost = lost  # names a rank whose process is gone
        self._outbox: list[RankCommand] = []
        self._remote: dict[int, _Remote] = {}
        self._remote_stats: dict[int, ExecutorStats] = {}
        self._remote_experts: dict[int, list[int]] = {}  # each rank's routing counts, reported
        self._affinity = PrefixAffinity(local.kv_cache_manager.tokens_per_block)
        self._slack = max(1, local.scheduler.max_batch_size // 2)

    # ---- what the LLM and the server read ----------------------------------------------------
    @property
    def kv_cache_manager(self):
        """Rank 0's KV cache manager (each rank has its own, of the same size)."""
        return self.local.kv_cache_manager

    @property
    def resource_manager(self):
        return self.local.resource_manager

    @property
    def spec_worker(self):
        """Rank 0's Eagle3 worker (every rank's resolves the same draft KV mode)."""
        return self.local.spec_worker

    @property
    def disagg(self):
        """Rank 0's disaggregation state (a context server is not attention-DP; a generation
        server's waiting requests are per rank)."""
        return self.local.disagg

    @property
    def active(self) -> list[LlmRequest]:
        """Every rank's unfinished requests (shadows for the other ranks')."""
        return self.local.active + [r.request for r in self._remote.values()]

    @property
    def has_work(self) -> bool:
        return self.local.has_work or bool(self._remote) or bool(self._outbox)

    @property
    def stats(self) -> ExecutorStats:
        """Every rank's counts, summed (the other ranks' as of the last step)."""
        total = dataclasses.replace(self.local.stats)
        for stats in self._remote_stats.values():
            for f in dataclasses.fields(ExecutorStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
        return total

    @property
    def limits(self) -> ExecutorLimits:
        """Rank 0's (every rank is built the same)."""
        return self.local.limits

    def snapshot(self, check_integrity: bool = False) -> ExecutorSnapshot:
        """Rank 0's KV; every rank's counts, requests and routing (the others' as last reported)."""
        local = self.local.snapshot(check_integrity)
        return dataclasses.replace(
            local, stats=self.stats, active_requests=len(self.active),
            expert_tokens=self.expert_tokens(),
        )  # fmt: skip

    def expert_tokens(self) -> list[int] | None:
        """Every rank's routing counts summed (the other ranks' as of their last report)."""
        total = self.local.expert_tokens()
        for counts in self._remote_experts.values():
            total = [a + b for a, b in zip(total, counts, strict=True)] if counts else total
        return total

    def rank_loads(self) -> list[int]:
        """Unfinished requests per rank."""
        loads = [0] * self.mapping.dp_size
        loads[0] = len(self.local.active) + len(self.local.disagg.waiting)
        for remote in self._remote.values():
            loads[remote.rank] += 1
        return loads

    # ---- what changes requests -----------------------------------------------------------------
    def enqueue_request(self, request: LlmRequest) -> None:
        if request.context_only:
            raise ValueError(
                "context-only requests need a context server without enable_attention_dp "
                "(tensor parallel or one rank): attention DP serves generation"
            )
        self._route(request, self.local.enqueue_request, submit_command)

    def enqueue_generation_only(self, request: LlmRequest, load_kv) -> None:
        """A request resumed from a context server, on the rank its prompt routes to: that rank
        pulls every head of the prompt's KV from the context ranks."""
        self._route(
            request,
            lambda r: self.local.enqueue_generation_only(r, load_kv),
            lambda r, rank: generation_only_command(r, load_kv.handle, rank),
        )

    def _route(self, request: LlmRequest, here, command) -> None:
        prompt = request.prompt_key_ids  # as the ranks' caches key it (images by digest)
        rank = choose_rank(self.rank_loads(), self._affinity.rank_for(prompt), self._slack)
        if rank == 0:
            here(request)
        else:
            self.local.check_request(request)  # every rank's cache has the same size
            self._remote[request.request_id] = _Remote(rank, request)
            self._outbox.append(command(request, rank))
        self._affinity.record(prompt, rank)

    def release_transferred(self, request_ids=None, revoke=None) -> int:
        return self.local.release_transferred(request_ids, revoke)

    def cancel_request(self, request_id: int) -> bool:
        return self.finish_request(request_id, FinishReason.CANCELLED)

    def finish_request(
        self, request_id: int, reason: FinishReason, stop_reason: int | str | None = None
    ) -> bool:
        """End a request here, or its shadow here and the request on its rank (cancelled there)."""
        remote = self._remote.pop(request_id, None)
        if remote is None:
            return self.local.finish_request(request_id, reason, stop_reason)
        remote.request.finish(reason, stop_reason)
        self._outbox.append(CancelCommand(remote.rank, request_id))
        return True

    def step(self) -> list[LlmRequest]:
        """One step on every rank; returns the requests (local and shadows) that finished."""
        commands, self._outbox = self._outbox, []
        try:
            send_step_commands(commands, self._lost)
        except Exception as exc:  # a rank is gone: no request can go on
            error = RequestError(ErrorKind.RANK_LOST, f"a rank is gone ({describe(exc)})")
            self.local.end_all(error)
            for remote in self._remote.values():
                remote.request.finish(FinishReason.ERROR, error)
            self._remote.clear()
            raise
        failure = None
        finished: list[LlmRequest] = []
        if self.local.has_work or self.mapping.moe_all_to_all:  # (then every rank steps)
            try:
                finished = self.local.step()
            except Exception as exc:  # the batch is already ended; the ranks must still meet
                failure = exc
        for rank, report in enumerate(gather_json({}, self.mapping.world_size)):
            if rank:
                finished += self._apply_report(rank, report)
        if failure is not None:
            raise failure
        return finished

    def _apply_report(self, rank: int, report: dict) -> list[LlmRequest]:
        self._remote_stats[rank] = ExecutorStats(**report["stats"])
        self._remote_experts[rank] = report["expert_tokens"]
        finished = []
        for update in report["requests"]:
            remote = self._remote.get(update["request_id"])
            if remote is None:  # cancelled here meanwhile
                continue
            apply_update(remote.request, update)
            if remote.request.is_finished:
                del self._remote[update["request_id"]]
                finished.append(remote.request)
        return finished


class ProgressReporter:
    """A follower rank's side: after each step, what changed in its requests since the last
    report, gathered to rank 0 (``AttentionDpExecutor._apply_report``). Every request is watched
    from before its first step, so one that a failed step ended is reported too."""

    def __init__(self, executor: PyExecutor, mapping: Mapping) -> None:
        self.executor = executor
        self.mapping = mapping
        # request id -> (the request, output tokens already reported)
        self._watched: dict[int, tuple[LlmRequest, int]] = {}
        self._experts = DeviceReadback()  # the routing counts, read without waiting for the step

    def before_step(self, started: list[LlmRequest]) -> None:
        """Watch the requests rank 0's commands ``started`` here (a generation-only one already
        has its first token, from the context server; one may have ended at once)."""
        for request in [*started, *self.executor.active]:
            self._watched.setdefault(request.request_id, (request, len(request.output_token_ids)))

    def after_step(self) -> None:
        updates = []
        for request_id, (request, sent) in list(self._watched.items()):
            if len(request.output_token_ids) == sent and not request.is_finished:
                continue
            updates.append(progress_update(request, sent))
            self._watched[request_id] = (request, len(request.output_token_ids))
            if request.is_finished:
                del self._watched[request_id]
        counts = self.executor.model_engine.expert_tokens()
        report = {
            "stats": dataclasses.asdict(self.executor.stats),
            "requests": updates,
            "expert_tokens": [] if counts is None else self._experts.refresh(counts),
        }
        try:
            gather_json(report, self.mapping.world_size)
        except Exception:
            logger.error("report to rank 0 failed:\n%s", traceback.format_exc())
            raise


def progress_update(request: LlmRequest, num_sent: int) -> dict:
    """The tokens of ``request`` after the first ``num_sent``, and its counters and end."""
    return {
        "request_id": request.request_id,
        "new_tokens": request.output_token_ids[num_sent:],
        "logprobs": request.py_logprobs[num_sent:],
        "generation_logits": [t.tolist() for t in request.py_generation_logits[num_sent:]],
        "num_decode_iterations": request.num_decode_iterations,
        "num_accepted_draft_tokens": request.num_accepted_draft_tokens,
        "num_reused_tokens": request.num_reused_tokens,
        "finish_reason": None if request.finish_reason is None else request.finish_reason.value,
        "stop_reason": stop_reason_to_json(request.stop_reason),
    }


def apply_update(shadow: LlmRequest, update: dict) -> None:
    """Bring a shadow up to date with its rank's report."""
    shadow.output_token_ids.extend(update["new_tokens"])
    shadow.py_logprobs.extend((lp, [tuple(t) for t in top]) for lp, top in update["logprobs"])
    shadow.py_generation_logits.extend(torch.tensor(t) for t in update["generation_logits"])
    shadow.num_decode_iterations = update["num_decode_iterations"]
    shadow.num_accepted_draft_tokens = update["num_accepted_draft_tokens"]
    shadow.num_reused_tokens = update["num_reused_tokens"]
    if shadow.output_token_ids and shadow.state is LlmRequestState.CONTEXT_INIT:
        shadow.state = LlmRequestState.GENERATION_IN_PROGRESS
    if update["finish_reason"] is not None:
        shadow.finish(
            FinishReason(update["finish_reason"]), stop_reason_from_json(update["stop_reason"])
        )
