"""DraftProbStore: the drafter's probabilities behind each sampled request's pending drafts, kept on
the device for the next step's rejection sampling (``acceptance.verify``).

A sampled request holds a slot of ``table [capacity + 1, max_draft_len, draft_vocab]`` while it
decodes. The step that drafts writes the slot (``write``), the next step's acceptance reads it
(``read``), both by index tensors, so the same code runs eagerly and inside a CUDA graph. Greedy
rows, padding rows and a request that found no free slot point at the last row, the scratch slot,
whose ``has_q`` stays false: their drafts are accepted greedily or, when sampled, by matching an
independent draw from the target (still exact, with fewer drafts accepted).

It is the executor's ``SPEC_RESOURCE_MANAGER``: a finished request's slot is freed with its KV.
The table is allocated when the first sampled request arrives and never moves after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest


class DraftProbStore(BaseResourceManager):
    def __init__(
        self, capacity: int, max_draft_len: int, draft_vocab: int, device: torch.device
    ) -> None:
        self.capacity = capacity
        self.shape = (capacity + 1, max_draft_len, draft_vocab)
        self.device = device
        self.table: torch.Tensor | None = None  # [capacity + 1, K, Vd] float32
        self.has_q: torch.Tensor | None = None  # [capacity + 1] bool: the slot's q is current
        self._slots: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def scratch(self) -> int:
        return self.capacity

    def get_max_resource_count(self) -> int:
        return self.capacity

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        return 0 if request.request_id in self._slots else 1

    def slots(self, requests: Sequence[LlmRequest]) -> list[int]:
        """Each request's slot: its own for a sampled request (given now if it had none, its
        ``has_q`` cleared), the scratch slot otherwise."""
        out, new = [], []
        for req in requests:
            if req.sampling_params.greedy:
                out.append(self.scratch)
                continue
            slot = self._slots.get(req.request_id)
            if slot is None and self._free:
                slot = self._slots[req.request_id] = self._free.pop()
                new.append(slot)
            out.append(self.scratch if slot is None else slot)
        if self.table is None and len(self._slots):
            self.allocate()
        elif new:
            self.has_q[torch.tensor(new).to(self.device, non_blocking=True)] = False
        return out

    def allocate(self) -> None:
        """The table, now (CUDA graphs that read it are captured at start-up)."""
        if self.table is None:
            self.table = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
            self.has_q = torch.zeros(self.shape[0], dtype=torch.bool, device=self.device)

    @property
    def allocated(self) -> bool:
        return self.table is not None

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [n, K, Vd]`` and ``has_q [n]`` of the slots ``[n]``."""
        return self.table[slots], self.has_q[slots]

    def write(self, slots: torch.Tensor, q: torch.Tensor, sampled: torch.Tensor) -> None:
        """The q of the drafts just made (``[n, K, Vd]``), current where ``sampled [n]``; rows at
        the scratch slot write ``has_q`` false (several may: they all write the same)."""
        self.table.index_copy_(0, slots, q)
        self.has_q.index_copy_(0, slots, sampled & (slots != self.scratch))

    def free_resources(self, request: LlmRequest) -> None:
        slot = self._slots.pop(request.request_id, None)
        if slot is not None:
            self._free.append(slot)
