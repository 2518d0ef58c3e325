"""The executor protocol: what the engine loop and ``LLM`` drive, one rank's ``PyExecutor`` or
rank 0's ``AttentionDpExecutor`` (``executors/data_parallel.py``) alike."""

from __future__ import annotations

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
    # steps with nothing to run here in which the rank took part in the MoE layers' exchanges
    num_idle_steps: int = 0

    @property
    def avg_decoded_tokens_per_iter(self) -> float | None:
        """Iteration-weighted acceptance length over every request so far."""
        if not self.num_decode_iterations:
            return None
        return 1.0 + self.num_accepted_draft_tokens / self.num_decode_iterations


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
