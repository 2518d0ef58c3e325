"""The generation side of ``KvCacheTransceiver``: pulling a context server's slots over NIXL.

A generation rank pulls from the context ranks that hold its heads (``head_regroup.source_ranks``):
whole slots straight into its own when the two layouts hold the same heads, else each source
rank's slots into a registered staging area, ``STAGING_BLOCKS`` at a time, then
``head_regroup.regroup_heads`` into its slots. After the data it reads back the hold's ticket from
every source rank it read (``transceiver.py`` says why); the notification that releases the hold
rides on context rank 0's ticket read, or is sent later (``confirm``) once every rank of a
tensor-parallel generation server has pulled its part.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Generator
from typing import TYPE_CHECKING, TypeVar

import torch

from tensorrt_llm._torch.disaggregation import DEFAULT_TRANSFER_TIMEOUT_S
from tensorrt_llm._torch.disaggregation.head_regroup import (
    RankSlots,
    attention_ranks,
    peer_layouts,
    regroup_heads,
    source_ranks,
)
from tensorrt_llm._torch.disaggregation.params import (
    TRANSFER_ID_PATTERN,
    LayoutFingerprint,
    SourceRank,
    TransferHandle,
)
from tensorrt_llm.logger import logger

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2

T = TypeVar("T")
_PULLED = b"pulled:"  # a finished (or abandoned) pull sends b"pulled:<transfer id>": free the hold
STALE_MARGIN_S = 0.25  # a pull must finish this long before the hold's expiry
_MAX_REMEMBERED_PULLS = 65536  # transfer ids a generation side remembers, to refuse a replay
STAGING_BLOCKS = 16  # blocks per source rank staged at once when heads are regrouped
TICKET_ROWS, TICKET_ROW_WORDS = 64, 16  # pulls in flight at once; context ranks read per pull
PULL_POLL_S = 0.0005  # how often a pull waited for here checks its transfers


def drive(steps: Generator[None, None, T]) -> T:
    """Run a pull's steps to their end here, checking its transfers every ``PULL_POLL_S``."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        time.sleep(PULL_POLL_S)


class StaleTransferError(ValueError):
    """A pull of a hold that has ended: its data cannot be trusted (a failure of the transfer,
    which the request may try again)."""


class ReplayedHandleError(ValueError):
    """A handle pulled here before: a handle serves one pull (the request's own fault)."""


def now() -> float:
    return time.time()


def encode_pulled(transfer_id: str) -> bytes:
    return _PULLED + transfer_id.encode()


def decode_pulled(message: bytes) -> str | None:
    """The transfer id a pull notification names, or None if it is not one."""
    if not message.startswith(_PULLED):
        return None
    body = message[len(_PULLED) :].decode("ascii", errors="replace")
    return body if re.fullmatch(TRANSFER_ID_PATTERN, body) else None


class PullSide:
    """``KvCacheTransceiver``'s methods that read a peer's slots; the transceiver provides the
    agent (``agent``, ``_read_steps``, ``_connect``), its ``manager``, ``fingerprint``, ``rank``,
    ``device_id``, ``mem_type`` and the registered ``_ticket_read`` words
    (``[TICKET_ROWS, TICKET_ROW_WORDS]``)."""

    agent: object
    manager: KVCacheManagerV2
    fingerprint: LayoutFingerprint
    rank: int
    device_id: int
    mem_type: str
    _ticket_read: torch.Tensor

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None  # registered lazily (heads regrouped)
        self._staging_owner: int | None = None  # the request whose pull uses it (one at a time)
        self._pulled: OrderedDict[str, None] = OrderedDict()  # ids pulled here
        self._pulling: set[str] = set()  # ids being pulled here
        # rows of ``_ticket_read`` not taken by a pull in flight (each reads its tickets there)
        self._free_ticket_rows = list(range(TICKET_ROWS))
        # READs given up while in flight that NIXL could not cancel, by the request they pulled
        # for, and the ticket rows they may still write: nothing they write into is reused
        # before they end (``settle``)
        self._parked: dict[int, list] = {}
        self._parked_rows: dict[int, list[int]] = {}

    @property
    def _split(self) -> tuple[int, int]:
        """How many ranks split this server's heads, and this rank's place among them (an
        attention-DP rank holds every head: one of one)."""
        ranks = attention_ranks(self.fingerprint.parallel)
        return ranks, self.rank if ranks > 1 else 0

    def check_peer(self, handle: TransferHandle) -> tuple[list, bool]:
        """The peer's per-rank slot layouts and whether its slots cross whole (same heads); a
        ``ValueError`` naming the difference when no transfer can bridge the two layouts."""
        try:
            return peer_layouts(handle.fingerprint, self.fingerprint, self.manager.layout.pools)
        except ValueError as exc:
            raise ValueError(
                f"incompatible KV cache layout on peer {handle.agent_name!r}: {exc}"
            ) from None

    def pull(
        self,
        request_id: int,
        handle: TransferHandle,
        num_blocks: int,
        start_block: int = 0,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        confirm: bool = True,
    ) -> int:
        """READ blocks ``[start_block, num_blocks)`` of the peer's request into this manager's slots
        of ``request_id`` (already allocated), from each context rank that holds this rank's
        heads, waiting here. Returns the bytes moved. ``StaleTransferError`` if the hold is near
        its end, was revoked before its tickets were read back after the data, or the handle was
        pulled here before. ``confirm=False``: the caller confirms the pull later (``confirm``),
        once every rank of this server has pulled its part."""
        return drive(
            self.pull_steps(request_id, handle, num_blocks, start_block, timeout_s, confirm)
        )

    def pull_steps(
        self,
        request_id: int,
        handle: TransferHandle,
        num_blocks: int,
        start_block: int = 0,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        confirm: bool = True,
    ) -> Generator[None, None, int]:
        """``pull`` as steps: a generator that yields while a READ is in flight (its driver does
        other work meanwhile, then resumes it) and returns the bytes moved. ``timeout_s`` bounds
        the whole pull. Closing it early gives up the pull (its transfers released)."""
        # no later than the hold's end (past it, the slots read may belong to another request)
        deadline = time.monotonic() + min(timeout_s, handle.expires_at - now() - STALE_MARGIN_S)
        layouts, whole = self.check_peer(handle)
        if handle.transfer_id in self._pulled or handle.transfer_id in self._pulling:
            raise ReplayedHandleError(
                f"request {request_id}: transfer {handle.transfer_id[:8]}... was already pulled "
                "here; a handle serves one pull"
            )
        self._check_live(request_id, handle)
        local_slots = self.manager.get_batch_cache_indices([request_id])[0][start_block:num_blocks]
        remote_slots = handle.slots[start_block:num_blocks]
        if len(local_slots) != len(remote_slots):
            raise ValueError(
                f"request {request_id}: {len(local_slots)} local slots for "
                f"{len(remote_slots)} remote ones"
            )
        my_ranks, my_rank = self._split
        their_ranks = len(handle.sources())
        used = [my_rank] if whole else source_ranks(my_rank, my_ranks, their_ranks)
        sources = [handle.sources()[r] for r in used]
        what = f"request {request_id}: KV pull from {[s.agent_name for s in sources]}"
        moved = 0
        self._pulling.add(handle.transfer_id)
        try:
            if local_slots:  # (none when this side's prefix cache held every block)
                if whole:
                    moved = yield from self._pull_whole(
                        sources[0], local_slots, remote_slots, what, (deadline, request_id)
                    )
                else:
                    moved = yield from self._pull_regrouped(
                        dict(zip(used, sources)),
                        their_ranks,
                        layouts,
                        (local_slots, remote_slots),
                        what,
                        (deadline, request_id),
                    )
            yield from self._check_tickets(request_id, handle, sources, confirm, deadline)
        finally:
            self._pulling.discard(handle.transfer_id)
        if confirm:
            self._remember(handle)
        return moved

    def confirm(self, handle: TransferHandle) -> None:
        """Tell the context server that this server pulled ``handle`` (every rank's part)."""
        self._remember(handle)
        self._notify(handle)

    def _remember(self, handle: TransferHandle) -> None:
        self._pulled[handle.transfer_id] = None
        while len(self._pulled) > _MAX_REMEMBERED_PULLS:
            self._pulled.popitem(last=False)

    def _descs(self, base: int, slots, size: int, device: int) -> list[tuple[int, int, int]]:
        return [(base + s * size, size, device) for s in slots]

    def _pull_whole(self, source: SourceRank, local_slots, remote_slots, what, until):
        """``until``: the pull's deadline and the request it pulls for."""
        local, remote = [], []
        for pool, remote_base in zip(self.manager.pools, source.pool_addresses, strict=True):
            size = pool.shape[1]
            local += self._descs(pool.data_ptr(), local_slots, size, self.device_id)
            remote += self._descs(remote_base, remote_slots, size, source.device_id)
        peer = self._connect(source)
        yield from self._read_steps(local, remote, self.mem_type, peer, b"", what, *until)
        return sum(size for _, size, _ in local)

    def _pull_regrouped(self, sources: dict, their_ranks, layouts, slots, what, until):
        """Pull each source rank's slots (``{rank: SourceRank}`` of a ``their_ranks``-way split)
        into staging, ``STAGING_BLOCKS`` at a time, and write this rank's heads into its own
        slots (``slots``: local and remote ids). One pull uses the staging area at a time: the
        others wait their turn (yielding)."""
        deadline, owner = until
        while self._staging_owner is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} timed out waiting for the staging area")
            yield
        self._staging_owner = owner
        try:
            return (
                yield from self._regroup_steps(sources, their_ranks, layouts, slots, what, until)
            )
        finally:
            if owner not in self._parked:  # (else it stays taken until the READ ends: settle)
                self._staging_owner = None

    def _regroup_steps(self, sources: dict, their_ranks, layouts, slots, what, until):
        local_slots, remote_slots = slots
        my_ranks, my_rank = self._split
        staging = self._staging_for(len(sources) * sum(p.slot_bytes for p in layouts))
        moved = 0
        for first in range(0, len(local_slots), STAGING_BLOCKS):
            mine = local_slots[first : first + STAGING_BLOCKS]
            theirs, offset, parts = remote_slots[first : first + STAGING_BLOCKS], 0, []
            for rank, source in sources.items():
                local, remote, views = [], [], []
                for layout, remote_base in zip(layouts, source.pool_addresses, strict=True):
                    size = layout.slot_bytes
                    view = staging[offset : offset + len(theirs) * size].view(len(theirs), size)
                    local += self._descs(view.data_ptr(), range(len(theirs)), size, self.device_id)
                    remote += self._descs(remote_base, theirs, size, source.device_id)
                    views.append(view)
                    offset += len(theirs) * size
                peer = self._connect(source)
                yield from self._read_steps(local, remote, self.mem_type, peer, b"", what, *until)
                moved += sum(size for _, size, _ in local)
                parts.append((rank, views))
            for i, (pool, layout) in enumerate(zip(self.manager.pools, self.manager.layout.pools)):
                dest = RankSlots(pool[mine], layout, my_rank, my_ranks)
                src = [RankSlots(v[i], layouts[i], r, their_ranks) for r, v in parts]
                regroup_heads(src, dest)
                pool[mine] = dest.slots
        return moved

    def _staging_for(self, nbytes_per_block: int) -> torch.Tensor:
        """A registered staging area of ``STAGING_BLOCKS`` blocks of ``nbytes_per_block``."""
        need = STAGING_BLOCKS * nbytes_per_block
        if self._staging is None or self._staging.numel() < need:
            if self._staging is not None:
                self.agent.deregister_memory(self._staging_registration)
            self._staging = torch.empty(need, dtype=torch.uint8, device=self.manager.device)
            self._staging_registration = self.agent.register_memory(self._staging)
        return self._staging

    def release(self, handle: TransferHandle) -> None:
        """Tell the context side that this side will not pull ``handle``: it frees the hold now
        instead of at its timeout. Best effort (the timeout still frees it)."""
        if handle.transfer_id not in self._pulled:
            self._notify(handle)

    def _notify(self, handle: TransferHandle) -> None:
        """The pull notification, to the context server's rank 0 (which decides releases)."""
        try:
            self.agent.send_notif(self._connect(handle), encode_pulled(handle.transfer_id))
        except Exception as exc:  # NIXL raises its own types; the hold still ends at its timeout
            logger.warning("could not notify transfer %s...: %s", handle.transfer_id[:8], exc)

    def _check_tickets(
        self,
        request_id: int,
        handle: TransferHandle,
        sources: list[SourceRank],
        notify: bool,
        deadline: float,
    ):
        """READ the hold's ticket back from each source rank, after the data, and refuse the
        data if one was revoked: those slots may have been freed during the READ. With
        ``notify``, the notification that releases the hold rides on rank 0's read, the last.
        Each pull in flight reads into its own row of ``_ticket_read``."""
        rank0 = handle.sources()[0]
        ordered = sorted(sources, key=lambda s: s.agent_name == rank0.agent_name)
        if notify and ordered[-1].agent_name != rank0.agent_name:
            ordered.append(rank0)  # only its notification is needed
        what = f"request {request_id}: reading the ticket of transfer {handle.transfer_id[:8]}..."
        while not self._free_ticket_rows:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} timed out waiting for a ticket row")
            yield
        row = self._free_ticket_rows.pop()
        try:
            words = self._ticket_read[row]
            yield from self._read_tickets(request_id, handle, ordered, notify, words, deadline)
        finally:
            if request_id in self._parked:  # a READ may still write the row: not reused yet
                self._parked_rows.setdefault(request_id, []).append(row)
            else:
                self._free_ticket_rows.append(row)

    def _read_tickets(self, request_id, handle, ordered, notify, words, deadline: float):
        if len(ordered) > len(words):
            raise ValueError(f"request {request_id}: {len(ordered)} context ranks to read from")
        what = f"request {request_id}: reading the ticket of transfer {handle.transfer_id[:8]}..."
        words.zero_()
        size = words.element_size()
        for i, source in enumerate(ordered):
            local = [(words.data_ptr() + i * size, size, 0)]
            remote = [(source.ticket_address, size, 0)]
            last = notify and i == len(ordered) - 1
            notice = encode_pulled(handle.transfer_id) if last else b""
            peer = self._connect(source)
            yield from self._read_steps(
                local, remote, "DRAM", peer, notice, what, deadline, request_id
            )
            if int(words[i]) != source.ticket:
                raise StaleTransferError(
                    f"request {request_id}: the context server ended the hold of transfer "
                    f"{handle.transfer_id[:8]}... before the pull finished (it timed out, or "
                    "another pull of the same handle came first); its slots may belong to "
                    "another request, so the KV is not used"
                )

    @staticmethod
    def _check_live(request_id: int, handle: TransferHandle) -> None:
        left = handle.expires_at - now()
        if left < STALE_MARGIN_S:
            raise StaleTransferError(
                f"request {request_id}: the context server's hold of transfer "
                f"{handle.transfer_id[:8]}... ends in {left:.3f}s before the pull (less than "
                f"{STALE_MARGIN_S}s); its slots may belong to another request, so the KV is not "
                "used. Raise cache_transceiver_config.transfer_timeout_s on the context server"
            )
