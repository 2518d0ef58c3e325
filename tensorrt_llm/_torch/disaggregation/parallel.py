"""Disaggregated serving on servers of several ranks: what the ranks of one server agree on.

- At start-up every rank of a tensor-parallel server sends rank 0 its transceiver's endpoint
  (agent, pools, ticket words) and takes rank 0's ticket key (``connect_ranks``), so rank 0 writes
  a handle for every rank (``KvCacheTransceiver.export``).
- A context-only request's hold starts on every rank in the same step (``hold_in_step``); the
  ranks meet once that step is over, so no handle leaves rank 0 before every rank's ticket is live.
- Rank 0 decides every release (a pull's notification reaches rank 0 only, and the timeout is
  rank 0's clock) and sends it to the other ranks with the next step's commands.
- A generation-only request runs on every tensor-parallel rank (each pulls its heads) or on one
  attention-DP rank. Tensor-parallel ranks admit it inside a step only, pull, then agree: if one
  rank's pull failed, the request fails on every rank, and only rank 0 talks to the context server.
  (The commands that carry releases and generation-only requests are ``executors/ranks.py``'s.)
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorrt_llm._torch.distributed.communicator import control_barrier, gather_json
from tensorrt_llm._torch.distributed.mapping import Mapping

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver


def in_lockstep(mapping: Mapping) -> bool:
    """Whether every rank runs every request (tensor parallelism over several ranks)."""
    return mapping.world_size > 1 and not mapping.enable_attention_dp


def connect_ranks(transceiver: KvCacheTransceiver, mapping: Mapping) -> None:
    """Every rank of a tensor-parallel server calls this once, at the same point of start-up."""
    key = secrets.token_bytes(32).hex() if mapping.rank == 0 else None
    gathered = gather_json({"endpoint": transceiver.endpoint(), "key": key}, mapping.world_size)
    transceiver.join_ranks([g["endpoint"] for g in gathered], bytes.fromhex(gathered[0]["key"]))


def hold_in_step(transceiver: KvCacheTransceiver, mapping: Mapping) -> Callable[[list[int]], None]:
    """The executor's ``on_hold``: start the holds of the requests a step ended with
    ``CONTEXT_DONE``, then (several ranks in step) wait for every rank to have started them."""

    def on_hold(request_ids: list[int]) -> None:
        for request_id in request_ids:
            transceiver.hold(request_id)
        if in_lockstep(mapping):
            control_barrier()

    return on_hold


def pull_options(mapping: Mapping) -> dict:
    """``PromptKvPull``'s ``agree`` and ``leader`` for this rank of ``mapping``."""
    if not in_lockstep(mapping):
        return {}
    return {
        "agree": lambda error: gather_json(error, mapping.world_size),
        "leader": mapping.rank == 0,
    }
