"""HostBlockTable: the host-side block table, one row per live sequence, as kernels consume it.

Layout (upstream's ``host_kv_cache_block_offsets``)::

    table[pool, row, lane, b] = slot id of logical block b of the sequence in ``row``
                                (lane 0: K, lane 1: V; both hold the slot id here)
    table: [num_pools, num_rows, 2, max_blocks_per_seq] int32, pinned when the device is CUDA

Entries past a row's last block hold 0. A row belongs to one sequence from ``add`` to ``remove``;
rows outnumber the batch when sequences wait outside it (held for a disaggregated transfer, say),
so the table doubles when it runs out. Only the rows of a scheduled batch are ever copied to a
device (``copy_batch``: gathered into pinned staging, then one queued copy). Owners: the KV cache manager writes rows; views (the Eagle3 draft sub-page
view) read them through ``batch_slot_rows``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tensorrt_llm.runtime.staging import PinnedStaging


class HostBlockTable:
    def __init__(
        self, num_pools: int, num_rows: int, max_blocks_per_seq: int, pin_memory: bool = False
    ) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        # [num_pools, num_rows, 2, max_blocks_per_seq]
        self.table = torch.zeros(
            num_pools, num_rows, 2, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin_memory
        )
        self._rows: dict[int, int] = {}
        self._lengths: dict[int, int] = {}  # blocks mirrored into each row
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._staging = PinnedStaging()  # the batch's rows on their way to a device

    @property
    def num_pools(self) -> int:
        return self.table.shape[0]

    @property
    def num_rows(self) -> int:
        return self.table.shape[1]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._rows

    # ---- rows -----------------------------------------------------------------------------------
    def add(self, seq_id: int) -> int:
        """Give ``seq_id`` an empty row; returns the row."""
        if seq_id in self._rows:
            raise ValueError(f"sequence {seq_id} already has a block-table row")
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._rows[seq_id] = row
        self._lengths[seq_id] = 0
        return row

    def remove(self, seq_id: int) -> None:
        """Clear and release ``seq_id``'s row (a no-op for an unknown id)."""
        row = self._rows.pop(seq_id, None)
        if row is None:
            return
        self.table[:, row].zero_()
        del self._lengths[seq_id]
        self._free_rows.append(row)

    def _grow(self) -> None:
        rows = self.num_rows
        grown = torch.zeros(
            self.num_pools,
            2 * rows,
            *self.table.shape[2:],
            dtype=self.table.dtype,
            pin_memory=self.table.is_pinned(),
        )
        grown[:, :rows] = self.table
        self.table = grown
        self._free_rows = list(range(2 * rows - 1, rows - 1, -1))

    def sync(self, seq_id: int, block_table: Sequence[int]) -> None:
        """Mirror ``block_table`` (slot ids) into ``seq_id``'s row: only the entries that changed."""
        row, old, new = self._rows[seq_id], self._lengths[seq_id], len(block_table)
        dst = self.table[:, row]  # [num_pools, 2, max_blocks_per_seq]
        if new > old:
            dst[:, :, old:new] = torch.tensor(block_table[old:], dtype=torch.int32)
        elif new < old:
            dst[:, :, new:old] = 0
        self._lengths[seq_id] = new

    # ---- batches --------------------------------------------------------------------------------
    def batch_rows(
        self, seq_ids: Sequence[int], beam_width: int = 1, num_seqs: int | None = None
    ) -> torch.Tensor:
        """Rows of the first ``num_seqs`` sequences (all if None), in batch order (one C-level map
        over the batch). Beam width 1 only."""
        if beam_width != 1:
            raise ValueError(f"beam_width={beam_width}: only 1 is supported")
        ids = seq_ids if num_seqs is None else seq_ids[:num_seqs]
        return torch.tensor(list(map(self._rows.__getitem__, ids)), dtype=torch.long)

    def batch_slot_rows(
        self, seq_ids: Sequence[int], beam_width: int = 1, num_seqs: int | None = None
    ) -> torch.Tensor:
        """``[n, max_blocks_per_seq]`` slot ids of the batch (pool 0, lane 0), for views."""
        return self.table[0, self.batch_rows(seq_ids, beam_width, num_seqs), 0]

    def copy_batch(
        self,
        dst: torch.Tensor,
        seq_ids: Sequence[int],
        beam_width: int = 1,
        num_seqs: int | None = None,
    ) -> None:
        """Gather the batch's rows into ``dst[:, :n]`` (``[num_pools, >= n, 2, max_blocks_per_seq]``)
        in one indexed copy."""
        rows = self.batch_rows(seq_ids, beam_width, num_seqs)
        if dst.device.type != "cuda":
            dst[:, : rows.numel()].copy_(self.table.index_select(1, rows))
            return
        shape = (self.table.shape[0], rows.numel(), *self.table.shape[2:])
        staged = self._staging.take(math.prod(shape), torch.int32).view(shape)
        torch.index_select(self.table, 1, rows, out=staged)  # gathered straight into pinned memory
        self._staging.copy_to(dst[:, : rows.numel()], staged)

    # ---- integrity ------------------------------------------------------------------------------
    def check(self, seq_id: int, block_table: Sequence[int]) -> None:
        """Raise ``AssertionError`` unless ``seq_id``'s row mirrors ``block_table`` exactly (both
        lanes, every pool) and holds nothing past it."""
        row = self.table[:, self._rows[seq_id]]
        n = len(block_table)
        expect = torch.tensor(list(block_table), dtype=torch.int32)
        if not (
            torch.equal(row[:, 0, :n], expect.expand(row.shape[0], n))
            and torch.equal(row[:, 1, :n], row[:, 0, :n])
        ):
            raise AssertionError(f"sequence {seq_id}: host block row differs from its block table")
        if bool(row[:, :, n:].any()):
            raise AssertionError(f"sequence {seq_id}: host block row has entries past its blocks")
