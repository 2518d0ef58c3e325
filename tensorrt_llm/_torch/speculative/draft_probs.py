"""DraftProbStore: the drafter's probabilities behind each sampled request's pending drafts, kept on
the device for the next step's rejection sampling (``acceptance.verify``).

A sampled request's row of ``table [slots + 1, max_draft_len, draft_vocab]`` is its request slot
(``SeqSlotManager``): every admitted request has one, so none goes without. The step that drafts
writes the row (``write``), the next step's acceptance reads it (``read``), both by index tensors,
so the same code runs eagerly and inside a CUDA graph. Greedy rows and padding rows point at the
last row, the scratch slot, whose ``has_q`` stays false: their drafts are accepted greedily.

It is the executor's ``SPEC_RESOURCE_MANAGER``. The table is allocated when the first sampled
request arrives (or for the CUDA graphs that read it, at start-up) and never moves after. With
relaxed acceptance it also holds each slot's thinking phase (``relaxed.ThinkingPhases``): then
greedy rows point at their own slots too (their ``has_q`` stays false).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager
from tensorrt_llm._torch.speculative.relaxed import RelaxedAcceptance, ThinkingPhases

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm._torch.pyexecutor.seq_slot_manager import SeqSlotManager


class DraftProbStore(BaseResourceManager):
    def __init__(
        self,
        seq_slots: SeqSlotManager,
        max_draft_len: int,
        draft_vocab: int,
        device: torch.device,
        relaxed: RelaxedAcceptance | None = None,
    ) -> None:
        self.seq_slots = seq_slots
        self.phases = (
            None if relaxed is None else ThinkingPhases(relaxed, seq_slots.capacity, device)
        )
        self.shape = (seq_slots.capacity + 1, max_draft_len, draft_vocab)
        self.device = device
        self.table: torch.Tensor | None = None  # [slots + 1, K, Vd] float32
        self.has_q: torch.Tensor | None = None  # [slots + 1] bool: the slot's q is current
        self._started: set[int] = set()  # sampled requests whose row's has_q was cleared

    @property
    def scratch(self) -> int:
        return self.seq_slots.scratch

    def get_max_resource_count(self) -> int:
        return self.seq_slots.capacity

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        return 0  # (its row is its request slot's)

    def slots(self, requests: Sequence[LlmRequest]) -> list[int]:
        """Each request's slot: its own for a sampled request, or any with relaxed acceptance
        (``has_q`` cleared and the thinking phase set at its first step: the row may hold the
        state of the request that had the slot before), the scratch slot otherwise."""
        out, new, started = [], [], []
        for req in requests:
            if req.sampling_params.greedy and self.phases is None:
                out.append(self.scratch)
                continue
            slot = self.seq_slots.slot(req)
            if req.request_id not in self._started:
                self._started.add(req.request_id)
                new.append(slot)
                started.append(req)
            out.append(slot)
        if new:
            self.allocate()
            self.has_q[torch.tensor(new).to(self.device, non_blocking=True)] = False
            if self.phases is not None:
                self.phases.start(new, [req.get_tokens() for req in started])
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
        self._started.discard(request.request_id)
