"""Moving a request's KV slots between a context server and a generation server over NIXL.

The generation side **pulls**: it allocates slots for the prompt, then issues one NIXL READ of whole
slots (every pool's ``slot_bytes`` per logical block) from the context side's pools. With the
unified KV cache a slot holds every layer's K/V, the index-K and the drafter's sub-pages, so all of
them arrive with no per-buffer code; with a separate draft manager only the target's pools are
registered, so the drafter's KV stays behind (upstream's behaviour, kept for measurement).

The control plane is a ``TransferHandle`` (JSON: agent metadata as base64 of NIXL's own bytes, slot
ids, pool base addresses and a layout fingerprint). When a READ completes, NIXL delivers a
notification to the context side; this module alone encodes and decodes it. Nothing is unpickled.

Each hold is one transfer with an unguessable ``transfer_id``, a ticket and an expiry:

- the context side releases a hold only on a notification naming a live transfer's id (an unknown,
  finished or malformed one is logged and skipped), so nobody can free another request's slots by
  naming its request id;
- the context side keeps a random nonce (the ticket) in a registered word while the hold lives and
  zeroes it *before* it frees the slots (``revoke``, called by the executor). The generation side
  READs the data, then READs the ticket back (the pull's notification rides on that second READ):
  if the ticket no longer matches, the slots may have been freed and given to another request
  during the READ, so the data is discarded with ``StaleTransferError``. This holds whatever the
  two clocks say, and it refuses a handle replayed to another generation server after its pull;
- the generation side also refuses a handle whose hold ends within ``STALE_MARGIN_S`` (before any
  read) and a handle it has already pulled;
- a generation side that will not pull (its request was cancelled or refused first) sends the
  same notification without a read (``release``), so the hold ends now, not at its timeout.
"""

from __future__ import annotations

import base64
import re
import secrets
import time
from collections import OrderedDict

import torch

from tensorrt_llm._torch.disaggregation import DEFAULT_TRANSFER_TIMEOUT_S
from tensorrt_llm._torch.disaggregation.params import (
    TRANSFER_ID_PATTERN,
    LayoutFingerprint,
    PoolFingerprint,
    TransferHandle,
)
from tensorrt_llm._torch.disaggregation.trust import deployment_secret
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm.logger import logger

_PULLED = b"pulled:"  # a finished (or abandoned) pull sends b"pulled:<transfer id>": free the hold
STALE_MARGIN_S = 0.25  # a pull must finish this long before the hold's expiry
_MAX_REMEMBERED_PULLS = 65536  # transfer ids a generation side remembers, to refuse a replay
MAX_HELD_TRANSFERS = 4096  # tickets a context side has: transfers held at once


class StaleTransferError(ValueError):
    """A pull of a hold that has ended, or of a handle already pulled: its data cannot be trusted."""


def _now() -> float:
    return time.time()


def layout_fingerprint(manager: KVCacheManagerV2, parallel: str = "tp1") -> LayoutFingerprint:
    """Everything two peers must agree on to exchange slots byte for byte, plus its digest;
    ``parallel`` is the server's parallel layout (``Mapping.describe()``)."""
    pools = [
        PoolFingerprint(
            slot_bytes=pool.slot_bytes,
            buffers=[(b.layer_id, b.role.value, b.offset, b.size, b.dtype) for b in pool.buffers],
        )
        for pool in manager.layout.pools
    ]
    return LayoutFingerprint.build(
        tokens_per_block=manager.tokens_per_block,
        layers=list(manager.pp_layers),
        draft_layers=[i for i in manager.pp_layers if manager.is_draft_layer(i)],
        pools=pools,
        parallel=parallel,
    )


def _encode_pulled(transfer_id: str) -> bytes:
    return _PULLED + transfer_id.encode()


def _decode_pulled(message: bytes) -> str | None:
    """The transfer id a pull notification names, or None if it is not one."""
    if not message.startswith(_PULLED):
        return None
    body = message[len(_PULLED) :].decode("ascii", errors="replace")
    return body if re.fullmatch(TRANSFER_ID_PATTERN, body) else None


class KvCacheTransceiver:
    def __init__(
        self,
        manager: KVCacheManagerV2,
        name: str,
        backends: tuple[str, ...] = ("UCX",),
        secret: bytes | None = None,
        parallel: str = "tp1",
    ) -> None:
        """``secret``: the deployment's (``trust.py``); None reads ``TRTLLM_DISAGG_SECRET``;
        ``parallel``: the server's parallel layout, part of the layout fingerprint."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.secret = deployment_secret() if secret is None else secret
        self.manager = manager
        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self.mem_type = "VRAM" if manager.device.type == "cuda" else "DRAM"
        self.device_id = manager.device.index or 0
        self._registrations = [self.agent.register_memory(pool) for pool in manager.pools]
        self.fingerprint = layout_fingerprint(manager, parallel)
        # context side: one word per held transfer, its nonce while live, 0 once revoked
        self._tickets = torch.zeros(MAX_HELD_TRANSFERS, dtype=torch.int64)
        self._free_tickets = list(range(MAX_HELD_TRANSFERS - 1, -1, -1))
        # generation side: where a peer's ticket is read back after the data (one pull at a time)
        self._ticket_read = torch.zeros(1, dtype=torch.int64)
        self._registrations += [
            self.agent.register_memory(t, "DRAM") for t in (self._tickets, self._ticket_read)
        ]
        self._peers: set[str] = set()
        self._live: dict[str, tuple[int, float]] = {}  # context side: id -> (request, expiry)
        self._holds: dict[int, tuple[str, int]] = {}  # context side: request -> (id, ticket index)
        self._pulled: OrderedDict[str, None] = OrderedDict()  # generation side: ids pulled

    def export(self, request_id: int, hold_s: float) -> TransferHandle:
        """A new transfer of ``request_id``'s slots, which this side holds for ``hold_s`` more
        seconds (until ``revoke``): the handle a generation server pulls them with."""
        self.revoke(request_id)  # a request has one transfer at a time
        if not self._free_tickets:
            raise RuntimeError(
                f"request {request_id}: {MAX_HELD_TRANSFERS} transfers are already held unpulled"
            )
        index = self._free_tickets.pop()
        ticket = secrets.randbits(63) or 1
        self._tickets[index] = ticket
        transfer_id = secrets.token_urlsafe(24)
        expires_at = _now() + hold_s
        self._live[transfer_id] = (request_id, expires_at)
        self._holds[request_id] = (transfer_id, index)
        return TransferHandle(
            request_id=request_id,
            transfer_id=transfer_id,
            expires_at=expires_at,
            agent_name=self.name,
            agent_metadata=base64.b64encode(self.agent.get_agent_metadata()).decode(),
            fingerprint=self.fingerprint,
            slots=self.manager.get_batch_cache_indices([request_id])[0],
            pool_addresses=[pool.data_ptr() for pool in self.manager.pools],
            ticket_address=self._tickets.data_ptr() + index * self._tickets.element_size(),
            ticket=ticket,
        )

    def revoke(self, request_id: int) -> None:
        """End ``request_id``'s transfer before its slots are freed: a pull of it that has not
        read its ticket back yet will find it gone and discard what it read."""
        transfer_id, index = self._holds.pop(request_id, (None, None))
        if transfer_id is None:
            return
        self._live.pop(transfer_id, None)
        self._tickets[index] = 0
        self._free_tickets.append(index)

    def check_peer(self, handle: TransferHandle) -> None:
        theirs = handle.fingerprint
        if theirs.digest != self.fingerprint.digest:
            diff = "; ".join(self.fingerprint.differences(theirs)) or "fingerprint digests differ"
            raise ValueError(f"incompatible KV cache layout on peer {handle.agent_name!r}: {diff}")

    def pull(
        self,
        request_id: int,
        handle: TransferHandle,
        num_blocks: int,
        start_block: int = 0,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> int:
        """READ blocks ``[start_block, num_blocks)`` of the peer's request into this manager's slots
        of ``request_id`` (already allocated). Returns the bytes moved. ``StaleTransferError`` if
        the hold is near its end, was revoked before its ticket was read back after the data, or
        the handle was pulled here before."""
        self.check_peer(handle)
        if handle.transfer_id in self._pulled:
            raise StaleTransferError(
                f"request {request_id}: transfer {handle.transfer_id[:8]}... was already pulled "
                "here; a handle serves one pull"
            )
        self._check_live(request_id, handle)
        peer = self._connect(handle)
        local_slots = self.manager.get_batch_cache_indices([request_id])[0][start_block:num_blocks]
        remote_slots = handle.slots[start_block:num_blocks]
        if len(local_slots) != len(remote_slots):
            raise ValueError(
                f"request {request_id}: {len(local_slots)} local slots for "
                f"{len(remote_slots)} remote ones"
            )
        local, remote = [], []
        for pool, remote_base in zip(self.manager.pools, handle.pool_addresses, strict=True):
            size = pool.shape[1]
            local += [(pool.data_ptr() + s * size, size, self.device_id) for s in local_slots]
            remote += [(remote_base + s * size, size, self.device_id) for s in remote_slots]
        if local:  # (none when this side's prefix cache held every block)
            what = f"request {request_id}: KV pull from {peer!r}"
            self._read(local, remote, self.mem_type, peer, b"", what, timeout_s)
        self._check_ticket(request_id, handle, timeout_s)
        self._pulled[handle.transfer_id] = None
        while len(self._pulled) > _MAX_REMEMBERED_PULLS:
            self._pulled.popitem(last=False)
        return sum(size for _, size, _ in local)

    def _connect(self, handle: TransferHandle) -> str:
        peer = handle.agent_name
        if peer not in self._peers:
            self.agent.add_remote_agent(handle.agent_metadata_bytes())
            self._peers.add(peer)
        return peer

    def release(self, handle: TransferHandle) -> None:
        """Tell the context side that this side will not pull ``handle``: it frees the hold now
        instead of at its timeout. Best effort (the timeout still frees it)."""
        if handle.transfer_id in self._pulled:
            return
        try:
            self.agent.send_notif(self._connect(handle), _encode_pulled(handle.transfer_id))
        except Exception as exc:  # NIXL raises its own types; the hold still ends at its timeout
            logger.warning("could not release transfer %s...: %s", handle.transfer_id[:8], exc)

    def _check_ticket(self, request_id: int, handle: TransferHandle, timeout_s: float) -> None:
        """READ the hold's ticket back (with the notification that releases the hold) and refuse
        the data if the context side revoked it: the slots may have been freed during the READ."""
        self._ticket_read.zero_()
        local = [(self._ticket_read.data_ptr(), self._ticket_read.element_size(), 0)]
        remote = [(handle.ticket_address, self._ticket_read.element_size(), 0)]
        what = f"request {request_id}: reading the ticket of transfer {handle.transfer_id[:8]}..."
        notice = _encode_pulled(handle.transfer_id)
        self._read(local, remote, "DRAM", handle.agent_name, notice, what, timeout_s)
        if int(self._ticket_read[0]) != handle.ticket:
            raise StaleTransferError(
                f"request {request_id}: the context server ended the hold of transfer "
                f"{handle.transfer_id[:8]}... before the pull finished (it timed out, or another "
                "pull of the same handle came first); its slots may belong to another request, so "
                "the KV is not used"
            )

    def _read(self, local, remote, mem_type, peer, notice, what, timeout_s) -> None:
        xfer = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, mem_type),
            self.agent.get_xfer_descs(remote, mem_type),
            peer,
            notice,
        )
        try:
            self._wait(xfer, what, timeout_s)
        finally:
            self.agent.release_xfer_handle(xfer)

    @staticmethod
    def _check_live(request_id: int, handle: TransferHandle) -> None:
        left = handle.expires_at - _now()
        if left < STALE_MARGIN_S:
            raise StaleTransferError(
                f"request {request_id}: the context server's hold of transfer "
                f"{handle.transfer_id[:8]}... ends in {left:.3f}s before the pull (less than "
                f"{STALE_MARGIN_S}s); its slots may belong to another request, so the KV is not "
                "used. Raise cache_transceiver_config.transfer_timeout_s on the context server"
            )

    def _wait(self, xfer, what: str, timeout_s: float) -> None:
        state = self.agent.transfer(xfer)
        deadline = time.monotonic() + timeout_s
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} timed out after {timeout_s}s")
            time.sleep(0.0005)
            state = self.agent.check_xfer_state(xfer)
        if state == "ERR":
            raise RuntimeError(f"{what} failed")

    def pulled_request_ids(self) -> list[int]:
        """Ids of this side's requests whose KV a peer finished pulling since the last call (to
        release). A notification that is not a pull's, or names no live transfer of this side
        (unknown, already released, expired), is logged and skipped; expired transfers are
        forgotten (the executor frees their holds at the timeout)."""
        ids = []
        for peer, messages in self.agent.get_new_notifs().items():
            for message in messages:
                transfer_id = _decode_pulled(message)
                live = self._live.pop(transfer_id, None) if transfer_id is not None else None
                if live is None:
                    logger.warning("ignoring a NIXL notification from %r: %r", peer, message[:64])
                elif live[1] < _now():
                    logger.warning(
                        "ignoring the pull of request %d from %r: its hold had ended", live[0], peer
                    )
                else:
                    ids.append(live[0])
        now = _now()
        for transfer_id in [t for t, (_, expiry) in self._live.items() if expiry < now]:
            del self._live[transfer_id]
        return ids
