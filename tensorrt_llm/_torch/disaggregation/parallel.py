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
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorrt_llm._torch.disaggregation.generation_only import PromptKvPull
from tensorrt_llm._torch.disaggregation.params import TransferHandle
from tensorrt_llm._torch.distributed.communicator import control_barrier, gather_json
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
    from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor


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


def generation_only_command(request: LlmRequest, handle: TransferHandle, rank: int) -> dict:
    """What another rank needs to start ``request`` (resumed from a context server) there."""
    from tensorrt_llm._torch.distributed.ranks import submit_command

    command = submit_command(request, rank)
    command.update(
        kind="generation_only",
        output_token_ids=list(request.output_token_ids),
        draft_tokens=list(request.py_draft_tokens),
        handle=handle.model_dump(mode="json"),
    )
    return command


def start_generation_only(
    executor: PyExecutor, transceiver: KvCacheTransceiver, mapping: Mapping, command: dict
) -> LlmRequest:
    """A follower's side of ``generation_only_command`` (rank 0 checked the request and its
    signature). A request that cannot start ends with ``FinishReason.ERROR``."""
    from tensorrt_llm._torch.distributed.ranks import request_from_json

    request = request_from_json(command["request"])
    request.output_token_ids = list(command["output_token_ids"])
    request.py_draft_tokens = list(command["draft_tokens"])
    try:
        handle = TransferHandle.model_validate(command["handle"])
        load_kv = PromptKvPull(executor, transceiver, handle, **pull_options(mapping))
        executor.enqueue_generation_only(request, load_kv)
    except ValueError as exc:
        if not request.is_finished:
            request.finish(FinishReason.ERROR, str(exc))
    return request


def release_command(request_ids: list[int]) -> dict:
    return {"kind": "release", "rank": -1, "request_ids": list(request_ids)}
