"""Moving a request's KV slots between a context server and a generation server over NIXL.

The generation side **pulls**: it allocates slots for the prompt, then issues one NIXL READ of whole
slots (every pool's ``slot_bytes`` per logical block) from the context side's pools. With the
unified KV cache a slot holds every layer's K/V, the index-K and the drafter's sub-pages, so all of
them arrive with no per-buffer code; with a separate draft manager only the target's pools are
registered, so the drafter's KV stays behind (upstream's behaviour, kept for measurement).

The control plane is plain JSON (``export`` / ``pull``): agent metadata as base64 of NIXL's own
bytes, slot ids, pool base addresses and a layout fingerprint. Nothing is unpickled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time

from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2


def layout_fingerprint(manager: KVCacheManagerV2) -> dict:
    """Everything two peers must agree on to exchange slots byte for byte, plus its digest."""
    pools = [
        {
            "slot_bytes": pool.slot_bytes,
            "buffers": [
                [b.layer_id, b.role.value, b.offset, b.size, b.dtype] for b in pool.buffers
            ],
        }
        for pool in manager.layout.pools
    ]
    body = {
        "tokens_per_block": manager.tokens_per_block,
        "layers": list(manager.pp_layers),
        "draft_layers": [i for i in manager.pp_layers if manager.is_draft_layer(i)],
        "pools": pools,
    }
    body["digest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return body


def _differences(mine: dict, theirs: dict) -> list[str]:
    keys = ("tokens_per_block", "layers", "draft_layers", "pools")
    return [
        f"{k}: local {mine.get(k)!r} vs peer {theirs.get(k)!r}"
        for k in keys
        if mine.get(k) != theirs.get(k)
    ]


class KvCacheTransceiver:
    def __init__(
        self, manager: KVCacheManagerV2, name: str, backends: tuple[str, ...] = ("UCX",)
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.manager = manager
        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self.mem_type = "VRAM" if manager.device.type == "cuda" else "DRAM"
        self.device_id = manager.device.index or 0
        self._registrations = [self.agent.register_memory(pool) for pool in manager.pools]
        self.fingerprint = layout_fingerprint(manager)
        self._peers: set[str] = set()

    def export(self, request_id: int) -> dict:
        """What a generation server needs to pull ``request_id``'s slots (JSON-serialisable)."""
        return {
            "request_id": request_id,
            "agent": self.name,
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "fingerprint": self.fingerprint,
            "slots": self.manager.get_batch_cache_indices([request_id])[0],
            "pool_addresses": [pool.data_ptr() for pool in self.manager.pools],
        }

    def check_peer(self, params: dict) -> None:
        theirs = params.get("fingerprint", {})
        if theirs.get("digest") != self.fingerprint["digest"]:
            diff = "; ".join(_differences(self.fingerprint, theirs)) or "fingerprint digests differ"
            raise ValueError(
                f"incompatible KV cache layout on peer {params.get('agent')!r}: {diff}"
            )

    def pull(
        self,
        request_id: int,
        params: dict,
        num_blocks: int,
        start_block: int = 0,
        timeout_s: float = 30.0,
    ) -> int:
        """READ blocks ``[start_block, num_blocks)`` of the peer's request into this manager's slots
        of ``request_id`` (already allocated). Returns the bytes moved."""
        self.check_peer(params)
        peer = params["agent"]
        if peer not in self._peers:
            self.agent.add_remote_agent(base64.b64decode(params["agent_metadata"]))
            self._peers.add(peer)
        local_slots = self.manager.get_batch_cache_indices([request_id])[0][start_block:num_blocks]
        remote_slots = params["slots"][start_block:num_blocks]
        if len(local_slots) != len(remote_slots):
            raise ValueError(
                f"request {request_id}: {len(local_slots)} local slots for {len(remote_slots)} remote ones"
            )
        local, remote = [], []
        for pool, remote_base in zip(self.manager.pools, params["pool_addresses"], strict=True):
            size = pool.shape[1]
            local += [(pool.data_ptr() + s * size, size, self.device_id) for s in local_slots]
            remote += [(remote_base + s * size, size, self.device_id) for s in remote_slots]
        if not local:
            return 0
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, self.mem_type),
            self.agent.get_xfer_descs(remote, self.mem_type),
            peer,
            f"pulled:{params.get('request_id', request_id)}".encode(),
        )
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"request {request_id}: KV pull from {peer!r} timed out after {timeout_s}s"
                    )
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"request {request_id}: KV pull from {peer!r} failed")
        finally:
            self.agent.release_xfer_handle(handle)
        return sum(size for _, size, _ in local)

    def pulled_requests(self) -> list[str]:
        """Notifications from peers that finished pulling (``pulled:<request id>``), for release."""
        notes = self.agent.get_new_notifs()
        return [m.decode() for messages in notes.values() for m in messages]
