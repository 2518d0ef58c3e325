"""SeqSlotManager: one slot per admitted request, upstream's name for it.

A request takes a slot when the scheduler grants it its KV (admission) and gives it back when it
leaves the batch. Every per-request row on the device is indexed by it: the penalties' counts and
bias (``LogitsState``) and the drafter's q (``DraftProbStore``), and through them the rows a graph
bucket reads. So a request has one capacity to fit in, and one way not to fit: admission waits.

Slot ``capacity`` is the scratch row of those tables: rows without that state, and a graph
bucket's padding rows, point at it. A slot given back may be taken by the next request at once:
the device runs the steps in launch order, so the last step that wrote the old request's rows
has written them before the new request's first step reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest


class SeqSlotManager(BaseResourceManager):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"SeqSlotManager: capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._slots: dict[int, int] = {}  # request id -> slot
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, request_id: int) -> bool:
        """Whether the request with this id is admitted (holds a slot)."""
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def scratch(self) -> int:
        return self.capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    def admit(self, request: LlmRequest) -> int:
        """``request``'s slot from now on (the caller checked ``num_free``)."""
        slot = self._slots.get(request.request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(
                    f"SeqSlotManager: all {self.capacity} slots are held; admission must wait"
                )
            slot = self._slots[request.request_id] = self._free.pop()
        return slot

    def slot(self, request: LlmRequest) -> int:
        """The slot of an admitted request."""
        try:
            return self._slots[request.request_id]
        except KeyError:
            raise RuntimeError(
                f"request {request.request_id} has no slot: it was not admitted"
            ) from None

    def release(self, request: LlmRequest) -> None:
        """``request`` leaves the batch; its slot is free (a second call does nothing)."""
        slot = self._slots.pop(request.request_id, None)
        if slot is not None:
            self._free.append(slot)

    def get_max_resource_count(self) -> int:
        return self.capacity

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        return 0 if request.request_id in self._slots else 1

    def free_resources(self, request: LlmRequest) -> None:
        self.release(request)
