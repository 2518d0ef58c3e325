"""The executor protocol: what the engine loop and ``LLM`` drive, one rank's ``PyExecutor`` or
rank 0's ``AttentionDpExecutor`` (``executors/data_parallel.py``) alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.coordinator import DisaggCoordinator, LoadKv
    from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager


@dataclass
class ExecutorStats:
    num_steps: int = 0
    num_context_tokens_computed: int = 0  # prompt tokens that went through a forward
    num_reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead
    num_generated_tokens: int = 0
    num_decode_iterations: int = 0
    num_accepted_draft_tokens: int = 0
    num_transferred_tokens: int = 0  # prompt tokens whose KV a generation-only request pulled
    num_overlapped_steps: int = 0  # steps launched before the one ahead of them was read
    num_graph_steps: int = 0  # steps replayed from a CUDA graph (the rest ran eagerly)
    num_mixed_graph_steps: int = 0  # of them, steps with a prompt
    # steps with nothing to run here in which the rank took part in the MoE layers' exchanges
    num_idle_steps: int = 0

    @property
    def avg_decoded_tokens_per_iter(self) -> float | None:
        """Iteration-weighted acceptance length over every request so far."""
        if not self.num_decode_iterations:
            return None
        return 1.0 + self.num_accepted_draft_tokens / self.num_decode_iterations


@dataclass(frozen=True)
class KvSlots:
    """One KV cache manager's slots (checked with ``check_integrity`` where the snapshot asked)."""

    free: int
    used: int
    cached: int  # free, but holding a reusable prefix
    live_requests: int
    reused_blocks: int


@dataclass(frozen=True)
class ExecutorSnapshot:
    """What an executor holds between two steps (``Executor.snapshot``): its counts, its requests
    and its KV, for ``LLM.get_stats``, the server's ``/metrics`` and the KV report."""

    stats: ExecutorStats
    active_requests: int
    held_for_transfer: int  # context-only requests whose KV waits for a generation server
    kv: dict[str, KvSlots]  # by manager (``ResourceManagerType`` value)
    expert_tokens: list[int] | None  # per expert, every rank's routed (token, choice) slots
    draft_kv_mode: str | None  # where the drafter's KV was found at the last step (None: not yet)


@dataclass(frozen=True)
class ExecutorLimits:
    """What an executor was built with (``Executor.limits``): the sizes a caller checks requests
    against and reports."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    kv_slots: int  # in the primary pool, per rank
    kv_usable_slots: int  # of those, what requests may hold (without the padding blocks)
    tokens_per_block: int
    request_slots: int  # admitted requests at once (``SeqSlotManager``)
    max_draft_len: int  # 0 without a drafter


class RankSync(Protocol):
    """What rank 0's executor tells the other ranks under tensor parallelism
    (``executors/ranks.py``: ``TensorParallelLeader``)."""

    def submitted(self, request: LlmRequest) -> None: ...

    def submitted_generation_only(self, request: LlmRequest, handle) -> None: ...

    def cancelled(self, request_id: int) -> None: ...

    def released(self, request_ids: list[int]) -> None: ...

    def start_step(self) -> None: ...


class Executor(Protocol):
    @property
    def has_work(self) -> bool:
        """Requests running or waiting for their KV."""

    @property
    def active(self) -> list[LlmRequest]: ...

    @property
    def stats(self) -> ExecutorStats: ...

    @property
    def resource_manager(self) -> ResourceManager: ...

    @property
    def disagg(self) -> DisaggCoordinator: ...

    @property
    def kv_cache_manager(self): ...

    @property
    def spec_worker(self): ...

    @property
    def limits(self) -> ExecutorLimits: ...

    def snapshot(self, check_integrity: bool = False) -> ExecutorSnapshot:
        """Counts, requests and KV slots now (between steps); with ``check_integrity`` each KV
        manager's invariants checked first (a walk of its whole pool: for reports and tests,
        never on the path of ``get_stats`` or a metrics scrape)."""

    def enqueue_request(self, request: LlmRequest) -> None:
        """Start ``request`` at its prompt; ``ValueError`` if it can never run here."""

    def enqueue_generation_only(self, request: LlmRequest, load_kv: LoadKv) -> None:
        """Start ``request`` at its first generation step, its prompt KV from ``load_kv``."""

    def cancel_request(self, request_id: int) -> bool:
        """End a request with ``FinishReason.CANCELLED`` and free its KV (False: not here)."""

    def finish_request(
        self, request_id: int, reason: FinishReason, stop_reason: int | str | None = None
    ) -> bool:
        """End a request with ``reason`` (a stop string the output side found) and free its KV."""

    def release_transferred(self, request_ids=None, revoke=None) -> int:
        """Free held context-only KV that was pulled or timed out."""

    def step(self) -> list[LlmRequest]:
        """One iteration; returns the requests that finished in it (already freed)."""

    def expert_tokens(self) -> list[int] | None:
        """Per expert, the (token, choice) slots every rank's tokens routed to it, summed over the
        MoE layers (None: no MoE layer)."""


def kv_slots(resource_manager: ResourceManager, check: bool = False) -> dict[str, KvSlots]:
    """Every KV cache manager's slots (``check``: each checked with ``check_integrity`` as it is
    counted, which walks its whole pool)."""
    out = {}
    for kind, manager in resource_manager.kv_cache_managers.items():
        if check:
            manager.check_integrity()
        s = manager.get_kv_cache_stats()
        out[kind.value] = KvSlots(
            s.num_free_slots, s.num_used_slots, s.num_cached_slots, s.num_live_sequences,
            s.num_reused_blocks,
        )  # fmt: skip
    return out


def snapshot_of(executor, check_integrity: bool = False) -> ExecutorSnapshot:
    """One rank's ``PyExecutor``'s snapshot."""
    worker = executor.spec_worker
    return ExecutorSnapshot(
        stats=dataclasses.replace(executor.stats),
        active_requests=len(executor.active),
        held_for_transfer=len(executor.disagg.held),
        kv=kv_slots(executor.resource_manager, check_integrity),
        expert_tokens=executor.expert_tokens(),
        draft_kv_mode=worker.draft_kv_mode if worker is not None else None,
    )


def limits_of(executor) -> ExecutorLimits:
    """One rank's ``PyExecutor``'s limits."""
    kv, worker = executor.kv_cache_manager, executor.spec_worker
    return ExecutorLimits(
        max_batch_size=executor.scheduler.max_batch_size,
        max_num_tokens=executor.scheduler.max_num_tokens,
        max_seq_len=executor.max_seq_len,
        kv_slots=kv.blocks_in_primary_pool,
        kv_usable_slots=kv.get_max_resource_count(),
        tokens_per_block=kv.tokens_per_block,
        request_slots=executor.seq_slots.capacity,
        max_draft_len=worker.max_draft_len if worker is not None else 0,
    )
