"""Scheduling results handed to the resource managers and the model engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest


@dataclass
class ScheduledRequests:
    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    # Requests the resource managers could not serve this step (for example, no KV slots);
    # the scheduler puts them back in the queue.
    paused_requests: list[LlmRequest] = field(default_factory=list)

    @property
    def all_requests(self) -> list[LlmRequest]:
        return self.context_requests + self.generation_requests

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)
