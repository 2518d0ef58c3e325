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

Servers of several ranks: every rank has its own agent, pools and tickets. A context server's
ranks hold and revoke in the same order (rank 0 decides every release and broadcasts it), so a
hold has the same ticket index on every rank, and each rank's ticket is an HMAC of the hold's
serial under a key rank 0 shares at start-up (``join_ranks``): rank 0 writes the handle for
every rank with no round trip. Only rank 0 reads notifications. A generation rank pulls from the
context ranks that hold its heads: whole slots straight into its own when the two layouts hold
the same heads, else into a staging area, then ``head_regroup.regroup_heads``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict

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
    PoolFingerprint,
    SourceRank,
    TransferHandle,
)
from tensorrt_llm._torch.disaggregation.trust import deployment_secret
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm.logger import logger

_PULLED = b"pulled:"  # a finished (or abandoned) pull sends b"pulled:<transfer id>": free the hold
STALE_MARGIN_S = 0.25  # a pull must finish this long before the hold's expiry
_MAX_REMEMBERED_PULLS = 65536  # transfer ids a generation side remembers, to refuse a replay
MAX_HELD_TRANSFERS = 4096  # tickets a context side has: transfers held at once
STAGING_BLOCKS = 16  # blocks per source rank staged at once when heads are regrouped


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
        rank: int = 0,
    ) -> None:
        """``secret``: the deployment's (``trust.py``); None reads ``TRTLLM_DISAGG_SECRET``;
        ``parallel``: the server's parallel layout (``Mapping.describe()``), part of the layout
        fingerprint; ``rank``: this process's rank in it."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.secret = deployment_secret() if secret is None else secret
        self.manager = manager
        self.name = name
        self.rank = rank
        self.agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self.mem_type = "VRAM" if manager.device.type == "cuda" else "DRAM"
        self.device_id = manager.device.index or 0
        self._registrations = [self.agent.register_memory(pool) for pool in manager.pools]
        self.fingerprint = layout_fingerprint(manager, parallel)
        # context side: one word per held transfer, its ticket while live, 0 once revoked
        self._tickets = torch.zeros(MAX_HELD_TRANSFERS, dtype=torch.int64)
        self._free_tickets = list(range(MAX_HELD_TRANSFERS - 1, -1, -1))
        self._ticket_key = secrets.token_bytes(32)
        self._serial = 0  # holds so far: a ticket is the HMAC of its hold's serial
        # generation side: where peers' tickets are read back after the data
        self._ticket_read = torch.zeros(64, dtype=torch.int64)
        self._registrations += [
            self.agent.register_memory(t, "DRAM") for t in (self._tickets, self._ticket_read)
        ]
        self._staging: torch.Tensor | None = None  # registered lazily (heads regrouped)
        # every rank's endpoint (rank 0 of a context server; ``join_ranks``), with what it registered
        self._endpoints: list[dict] = [self.endpoint()]
        self._peers: set[str] = set()
        self._live: dict[str, tuple[int, float]] = {}  # context side: id -> (request, expiry)
        self._holds: dict[int, tuple[int, int]] = {}  # context side: request -> (index, serial)
        self._exported: dict[int, str] = {}  # context side: request -> its transfer's id
        self._pulled: OrderedDict[str, None] = OrderedDict()  # generation side: ids pulled

    # ---- several ranks -----------------------------------------------------------------------
    def endpoint(self) -> dict:
        """What rank 0 needs to write this rank's part of a handle (JSON)."""
        return {
            "agent_name": self.name,
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "pool_addresses": [pool.data_ptr() for pool in self.manager.pools],
            "device_id": self.device_id,
            "ticket_base": self._tickets.data_ptr(),
        }

    def join_ranks(self, endpoints: list[dict], ticket_key: bytes) -> None:
        """Every rank's ``endpoint()`` in rank order, and the ticket key all ranks use (rank 0's)."""
        if endpoints[self.rank]["agent_name"] != self.name:
            raise ValueError(f"endpoint {self.rank} is not this rank's agent {self.name!r}")
        self._endpoints, self._ticket_key = list(endpoints), ticket_key

    def _ticket(self, rank: int, serial: int) -> int:
        digest = hmac.new(self._ticket_key, b"%d/%d" % (rank, serial), hashlib.sha256).digest()
        return (int.from_bytes(digest[:8], "little") >> 1) or 1

    # ---- context side --------------------------------------------------------------------------
    def hold(self, request_id: int) -> None:
        """``request_id``'s slots start waiting for a pull (the executor calls this on every rank,
        in the same order): its ticket goes live."""
        if request_id in self._holds:
            return
        if not self._free_tickets:
            raise RuntimeError(
                f"request {request_id}: {MAX_HELD_TRANSFERS} transfers are already held unpulled"
            )
        index, self._serial = self._free_tickets.pop(), self._serial + 1
        self._tickets[index] = self._ticket(self.rank, self._serial)
        self._holds[request_id] = (index, self._serial)

    def export(self, request_id: int, hold_s: float) -> TransferHandle:
        """A new transfer of ``request_id``'s held slots, which this side holds for ``hold_s``
        more seconds (until ``revoke``): the handle a generation server pulls them with. On a
        single rank a second export of a request ends its first transfer."""
        if request_id in self._exported or request_id not in self._holds:
            if len(self._endpoints) > 1:
                state = "was exported already" if request_id in self._exported else "is not held"
                raise ValueError(f"request {request_id} {state}: ranks hold in step, once each")
            self.revoke(request_id)  # a request has one transfer at a time
            self.hold(request_id)
        index, serial = self._holds[request_id]
        transfer_id = secrets.token_urlsafe(24)
        expires_at = _now() + hold_s
        self._live[transfer_id] = (request_id, expires_at)
        self._exported[request_id] = transfer_id
        first, *others = [
            SourceRank(
                agent_name=e["agent_name"],
                agent_metadata=e["agent_metadata"],
                pool_addresses=e["pool_addresses"],
                device_id=e["device_id"],
                ticket_address=e["ticket_base"] + index * self._tickets.element_size(),
                ticket=self._ticket(rank, serial),
            )
            for rank, e in enumerate(self._endpoints)
        ]
        return TransferHandle(
            request_id=request_id,
            transfer_id=transfer_id,
            expires_at=expires_at,
            fingerprint=self.fingerprint,
            slots=self.manager.get_batch_cache_indices([request_id])[0],
            other_ranks=others,
            **first.model_dump(),
        )

    def revoke(self, request_id: int) -> None:
        """End ``request_id``'s hold before its slots are freed: a pull of it that has not
        read its ticket back yet will find it gone and discard what it read."""
        index, _ = self._holds.pop(request_id, (None, None))
        self._live.pop(self._exported.pop(request_id, ""), None)
        if index is not None:
            self._tickets[index] = 0
            self._free_tickets.append(index)

    # ---- generation side -----------------------------------------------------------------------
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
        heads. Returns the bytes moved. ``StaleTransferError`` if the hold is near its end, was
        revoked before its tickets were read back after the data, or the handle was pulled here
        before. ``confirm=False``: the caller confirms the pull later (``confirm``), once every
        rank of this server has pulled its part."""
        layouts, whole = self.check_peer(handle)
        if handle.transfer_id in self._pulled:
            raise StaleTransferError(
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
        my_ranks, their_ranks = attention_ranks(self.fingerprint.parallel), len(handle.sources())
        my_rank = self.rank if my_ranks > 1 else 0
        used = [my_rank] if whole else source_ranks(my_rank, my_ranks, their_ranks)
        sources = [handle.sources()[r] for r in used]
        what = f"request {request_id}: KV pull from {[s.agent_name for s in sources]}"
        moved = 0
        if local_slots:  # (none when this side's prefix cache held every block)
            if whole:
                moved = self._pull_whole(sources[0], local_slots, remote_slots, what, timeout_s)
            else:
                moved = self._pull_regrouped(
                    dict(zip(used, sources)),
                    their_ranks,
                    layouts,
                    (local_slots, remote_slots),
                    what,
                    timeout_s,
                )
        self._check_tickets(request_id, handle, sources, confirm, timeout_s)
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

    def _pull_whole(self, source: SourceRank, local_slots, remote_slots, what, timeout_s) -> int:
        local, remote = [], []
        for pool, remote_base in zip(self.manager.pools, source.pool_addresses, strict=True):
            size = pool.shape[1]
            local += self._descs(pool.data_ptr(), local_slots, size, self.device_id)
            remote += self._descs(remote_base, remote_slots, size, source.device_id)
        self._read(local, remote, self.mem_type, self._connect(source), b"", what, timeout_s)
        return sum(size for _, size, _ in local)

    def _pull_regrouped(self, sources: dict, their_ranks, layouts, slots, what, timeout_s) -> int:
        """Pull each source rank's slots (``{rank: SourceRank}`` of a ``their_ranks``-way split)
        into staging, ``STAGING_BLOCKS`` at a time, and write this rank's heads into its own
        slots (``slots``: local and remote ids)."""
        local_slots, remote_slots = slots
        my_ranks = attention_ranks(self.fingerprint.parallel)
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
                self._read(local, remote, self.mem_type, peer, b"", what, timeout_s)
                moved += sum(size for _, size, _ in local)
                parts.append((rank, views))
            for i, (pool, layout) in enumerate(zip(self.manager.pools, self.manager.layout.pools)):
                dest = RankSlots(pool[mine], layout, self.rank if my_ranks > 1 else 0, my_ranks)
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

    def _connect(self, source: SourceRank | TransferHandle) -> str:
        peer = source.agent_name
        if peer not in self._peers:
            self.agent.add_remote_agent(source.agent_metadata_bytes())
            self._peers.add(peer)
        return peer

    def release(self, handle: TransferHandle) -> None:
        """Tell the context side that this side will not pull ``handle``: it frees the hold now
        instead of at its timeout. Best effort (the timeout still frees it)."""
        if handle.transfer_id not in self._pulled:
            self._notify(handle)

    def _notify(self, handle: TransferHandle) -> None:
        """The pull notification, to the context server's rank 0 (which decides releases)."""
        try:
            self.agent.send_notif(self._connect(handle), _encode_pulled(handle.transfer_id))
        except Exception as exc:  # NIXL raises its own types; the hold still ends at its timeout
            logger.warning("could not notify transfer %s...: %s", handle.transfer_id[:8], exc)

    def _check_tickets(
        self,
        request_id: int,
        handle: TransferHandle,
        sources: list[SourceRank],
        notify: bool,
        timeout_s: float,
    ) -> None:
        """READ the hold's ticket back from each source rank, after the data, and refuse the
        data if one was revoked: those slots may have been freed during the READ. With
        ``notify``, the notification that releases the hold rides on rank 0's read, the last."""
        rank0 = handle.sources()[0]
        ordered = sorted(sources, key=lambda s: s.agent_name == rank0.agent_name)
        if notify and ordered[-1].agent_name != rank0.agent_name:
            ordered.append(rank0)  # only its notification is needed
        self._ticket_read.zero_()
        size = self._ticket_read.element_size()
        what = f"request {request_id}: reading the ticket of transfer {handle.transfer_id[:8]}..."
        for i, source in enumerate(ordered):
            local = [(self._ticket_read.data_ptr() + i * size, size, 0)]
            remote = [(source.ticket_address, size, 0)]
            last = notify and i == len(ordered) - 1
            notice = _encode_pulled(handle.transfer_id) if last else b""
            self._read(local, remote, "DRAM", self._connect(source), notice, what, timeout_s)
            if int(self._ticket_read[i]) != source.ticket:
                raise StaleTransferError(
                    f"request {request_id}: the context server ended the hold of transfer "
                    f"{handle.transfer_id[:8]}... before the pull finished (it timed out, or "
                    "another pull of the same handle came first); its slots may belong to "
                    "another request, so the KV is not used"
                )

    def _read(self, local, remote, mem_type, peer, notice, what, timeout_s) -> None:
        try:
            xfer = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local, mem_type),
                self.agent.get_xfer_descs(remote, mem_type),
                peer,
                notice,
            )
        except Exception as exc:  # NIXL's own error types name only a status code
            raise RuntimeError(
                f"{what}: NIXL could not set up the READ from {peer!r} ({type(exc).__name__}: "
                f"{exc}); the peer's memory is not registered as this side describes it"
            ) from exc
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
