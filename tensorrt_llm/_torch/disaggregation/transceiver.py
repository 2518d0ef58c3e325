"""Moving a request's KV slots between a context server and a generation server over NIXL.

The generation side **pulls**: it allocates slots for the prompt, then issues one NIXL READ of whole
slots (every pool's ``slot_bytes`` per logical block) from the context side's pools. With the
unified KV cache a slot holds every layer's K/V, the index-K and the drafter's sub-pages (and an
FP8 cache's scales), so all of them arrive with no per-buffer code; with a separate draft manager
only the target's pools are registered, so the drafter's KV stays behind (upstream's behaviour,
kept for measurement).

The control plane is a ``TransferHandle`` (JSON: agent metadata as base64 of NIXL's own bytes, slot
ids, pool base addresses and a layout fingerprint: the KV dtype, every buffer's place and dtype).
Servers of different KV dtypes are refused before any slot is taken (``head_regroup.peer_layouts``).
When a READ completes, NIXL delivers a notification to the context side; this module alone encodes
and decodes it. Nothing is unpickled.

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
  read) and a handle it has already pulled (``ReplayedHandleError``);
- a generation side that will not pull (its request was cancelled or refused first) sends the
  same notification without a read (``release``), so the hold ends now, not at its timeout.

Servers of several ranks: every rank has its own agent, pools and tickets. A context server's
ranks hold and revoke in the same order (rank 0 decides every release and broadcasts it), so a
hold has the same ticket index on every rank, and each rank's ticket is an HMAC of the hold's
serial under a key rank 0 shares at start-up (``join_ranks``): rank 0 writes the handle for
every rank with no round trip. Only rank 0 reads notifications. A generation rank pulls from the
context ranks that hold its heads: whole slots straight into its own when the two layouts hold
the same heads, else into a staging area, then ``head_regroup.regroup_heads`` (the generation
side's methods are in ``pulls.py``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time

import torch

from tensorrt_llm._torch.disaggregation.agent import make_agent
from tensorrt_llm._torch.disaggregation.params import (
    LayoutFingerprint,
    PoolFingerprint,
    SourceRank,
    TransferHandle,
)
from tensorrt_llm._torch.disaggregation.pulls import (
    TICKET_ROW_WORDS,
    TICKET_ROWS,
    PullSide,
    ReplayedHandleError,
    StaleTransferError,
    decode_pulled,
    now,
)
from tensorrt_llm._torch.disaggregation.trust import deployment_secret
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm.logger import logger

__all__ = ["KvCacheTransceiver", "ReplayedHandleError", "StaleTransferError", "layout_fingerprint"]
MAX_HELD_TRANSFERS = 4096  # tickets a context side has: transfers held at once


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
        kv_dtype=manager.dtype,
        tokens_per_block=manager.tokens_per_block,
        layers=list(manager.pp_layers),
        draft_layers=[i for i in manager.pp_layers if manager.is_draft_layer(i)],
        pools=pools,
        parallel=parallel,
    )


class KvCacheTransceiver(PullSide):
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
        super().__init__()

        self.secret = deployment_secret() if secret is None else secret
        self.manager = manager
        self.name = name
        self.rank = rank
        self.agent = make_agent(name, backends)
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
        self._ticket_read = torch.zeros(TICKET_ROWS, TICKET_ROW_WORDS, dtype=torch.int64)
        self._registrations += [
            self.agent.register_memory(t, "DRAM") for t in (self._tickets, self._ticket_read)
        ]
        # every rank's endpoint (rank 0 of a context server; ``join_ranks``), with what it registered
        self._endpoints: list[dict] = [self.endpoint()]
        self._peers: set[str] = set()
        self._live: dict[str, tuple[int, float]] = {}  # context side: id -> (request, expiry)
        self._holds: dict[int, tuple[int, int]] = {}  # context side: request -> (index, serial)
        self._exported: dict[int, str] = {}  # context side: request -> its transfer's id

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
        expires_at = now() + hold_s
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

    def close(self) -> None:
        """Deregister this side's memory and end its NIXL agent, and the agent's thread with it
        (``LLM.shutdown``), and let go of the KV manager. Nothing can be pulled from or by this
        side after."""
        agent, self.agent = self.agent, None
        self.manager = None  # (the device memory is freed with the executor)
        if agent is None:
            return
        registrations = list(self._registrations)
        if self._staging is not None:
            registrations.append(self._staging_registration)
        for registration in registrations:
            try:
                agent.deregister_memory(registration)
            except Exception as exc:  # NIXL raises its own types; the agent ends regardless
                logger.warning("NIXL could not deregister memory at shutdown: %s", exc)
        self._registrations, self._staging = [], None

    def _connect(self, source: SourceRank | TransferHandle) -> str:
        peer = source.agent_name
        if peer not in self._peers:
            self.agent.add_remote_agent(source.agent_metadata_bytes())
            self._peers.add(peer)
        return peer

    def _read_steps(self, local, remote, mem_type, peer, notice, what, deadline: float, owner: int):
        """One NIXL READ as steps: yields while it is in flight; ``TimeoutError`` once
        ``deadline`` (``time.monotonic()``) passes, ``RuntimeError`` if it fails. Leaving early
        (the pull given up) releases the transfer, or parks it for ``owner`` (the local request
        whose pull it is) when NIXL cannot cancel it in flight (``settle``)."""
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
            state = self.agent.transfer(xfer)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} timed out: the peer did not answer in time")
                yield
                state = self.agent.check_xfer_state(xfer)
            if state == "ERR":
                raise RuntimeError(f"{what} failed")
        finally:
            self._give_back(xfer, owner)

    def settle(self, request_id: int) -> bool:
        """Whether no READ given up for ``request_id``'s pull is still in flight (its slots, and
        the staging area and ticket row it used, may then be reused); releases those that ended."""
        parked = self._parked.pop(request_id, None)
        if parked:
            left = [xfer for xfer in parked if not self._ended(xfer)]
            if left:
                self._parked[request_id] = left
                return False
        self._free_ticket_rows += self._parked_rows.pop(request_id, [])
        if self._staging_owner == request_id:
            self._staging_owner = None
        return True

    def _give_back(self, xfer, owner: int) -> None:
        """Release a READ's handle; one NIXL cannot release (in flight and not cancellable)
        waits, parked for ``owner``, until it ends."""
        try:
            self.agent.release_xfer_handle(xfer)
        except Exception as exc:  # NIXL raises its own types
            logger.warning(
                "request %d: a READ could not be cancelled (%s); it is let end", owner, exc
            )
            self._parked.setdefault(owner, []).append(xfer)

    def _ended(self, xfer) -> bool:
        try:
            if self.agent.check_xfer_state(xfer) not in ("DONE", "ERR"):
                return False
        except Exception:  # (NIXL's own types): the transfer is over, one way or another
            pass
        try:
            self.agent.release_xfer_handle(xfer)
        except Exception:
            return False
        return True

    def pulled_request_ids(self) -> list[int]:
        """Ids of this side's requests whose KV a peer finished pulling since the last call (to
        release). A notification that is not a pull's, or names no live transfer of this side
        (unknown, already released, expired), is logged and skipped; expired transfers are
        forgotten (the executor frees their holds at the timeout)."""
        ids = []
        for peer, messages in self.agent.get_new_notifs().items():
            for message in messages:
                transfer_id = decode_pulled(message)
                live = self._live.pop(transfer_id, None) if transfer_id is not None else None
                if live is None:
                    logger.warning("ignoring a NIXL notification from %r: %r", peer, message[:64])
                elif live[1] < now():
                    logger.warning(
                        "ignoring the pull of request %d from %r: its hold had ended", live[0], peer
                    )
                else:
                    ids.append(live[0])
        ended = now()
        for transfer_id in [t for t, (_, expiry) in self._live.items() if expiry < ended]:
            del self._live[transfer_id]
        return ids
