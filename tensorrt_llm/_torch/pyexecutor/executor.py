"""The executor protocol: what the engine loop and ``LLM`` drive, one rank's ``PyExecutor`` or
rank 0's ``AttentionDpExecutor`` (``distributed/data_parallel.py``) alike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.coordinator import DisaggCoordinator, LoadKv
    from tensorrt_llm._torch.pyexecutor.py_executor import ExecutorStats
    from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager


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
