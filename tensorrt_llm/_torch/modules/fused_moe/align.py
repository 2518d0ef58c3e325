"""Token slots sorted by expert and padded to the kernels' row block, on the device.

A step routes ``num_tokens`` tokens to ``top_k`` experts each: ``num_slots = num_tokens * top_k``
(token, choice) slots, slot ``s`` being token ``s // top_k``'s ``s % top_k``-th choice. The grouped
GEMMs take their rows ``block_m`` at a time, every row of a block for one expert, so each expert's
slots are laid out in a run padded to a multiple of ``block_m``::

    expert:          0 0 0 . | 2 . . . | 5 5 5 5 | 5 . . . | (unused blocks)
    sorted_slots:    3 6 9 S | 1 S S S | 0 2 4 7 | 8 S S S | S S ...      (S = num_slots: padding)
    block_expert:    0       | 2       | 5       | 5       | -1 ...

Every size here depends on ``num_tokens`` only, never on the routing: the number of blocks is the
worst case, ``cdiv(num_slots + min(num_slots, num_experts) * (block_m - 1), block_m)``, and blocks
past the last expert's run say ``-1`` (the kernels skip them). Nothing is read back to the host,
so a CUDA graph captures it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBlocks:
    sorted_slots: torch.Tensor  # [num_blocks * block_m] int32: slot ids by expert, num_slots = pad
    block_expert: torch.Tensor  # [num_blocks] int32: each block's expert, -1 past the last run
    num_slots: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most blocks ``num_slots`` slots can need: each expert hit pads at most ``block_m - 1``."""
    return -(-(num_slots + min(num_slots, num_experts) * (block_m - 1)) // block_m)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """``ids [num_tokens, top_k]`` (each slot's expert) -> the slots sorted by expert, each
    expert's run padded to ``block_m`` (the order within a run is the slots' order)."""
    flat = ids.reshape(-1).long()  # [num_slots]
    num_slots = flat.numel()
    # a slot of -1 is another rank's expert (expert parallelism): a run past the last, of no
    # blocks, whose slots are written to one spare row past the blocks and dropped
    flat = torch.where(flat < 0, num_experts, flat)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [num_experts + 1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded = torch.cat([padded, torch.zeros_like(counts[:1])])  # (no scalar from the host)
    run_end = torch.cumsum(padded, 0)  # [num_experts + 1]
    run_start = run_end - padded
    order = torch.sort(flat, stable=True).indices  # slots by expert  [num_slots]
    expert_of = flat[order]
    rank = (
        torch.arange(num_slots, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    )
    num_blocks = max_blocks(num_slots, num_experts, block_m)
    spare = num_blocks * block_m
    sorted_slots = torch.full((spare + 1,), num_slots, dtype=torch.int32, device=ids.device)
    where = torch.where(expert_of < num_experts, run_start[expert_of] + rank, spare)
    sorted_slots[where] = order.int()
    sorted_slots = sorted_slots[:spare]
    run_end = run_end[:num_experts]
    block_start = torch.arange(num_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(run_end, block_start, right=True)  # the run holding it
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).int()
    return ExpertBlocks(sorted_slots, block_expert, num_slots, block_m)
