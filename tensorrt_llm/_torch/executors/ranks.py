"""Keeping several ranks' executors in step: rank 0 takes the requests, the others follow.

Every rank runs its own ``PyExecutor``. Rank 0 (the process the user or the server talks to)
records what changes its requests between steps (``submit``, ``cancel``: typed commands,
``commands.py``) and, at the start of every step, broadcasts them as JSON over the control group;
each other rank applies the same commands to its executor and steps it (``follow``).

- Tensor parallelism: every rank runs every request. Scheduling and KV bookkeeping are
  deterministic, the logits are gathered to every rank and sampling is seeded (rank 0 draws a seed
  for a sampled request that has none), so the ranks make the same decisions; the model's
  collectives keep them together inside a step.
- Attention DP (``data_parallel.py``): each command names the rank that runs the request; after
  each step every rank reports its requests' progress back to rank 0.

Requests travel as plain JSON (``request_to_json``): no pickle between processes.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tensorrt_llm._torch.disaggregation.generation_only import PromptKvPull
from tensorrt_llm._torch.disaggregation.parallel import pull_options
from tensorrt_llm._torch.disaggregation.params import TransferHandle
from tensorrt_llm._torch.distributed.communicator import broadcast_bytes
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.executors import commands as cmd
from tensorrt_llm._torch.executors.commands import (
    EVERY_RANK,
    CancelCommand,
    GenerationOnlyCommand,
    RankCommand,
    ReleaseCommand,
    ShutdownCommand,
    SubmitCommand,
)
from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, LlmRequest
from tensorrt_llm.inputs.image_processing import images_from_json, images_to_json
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
    from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor


class RanksLostError(RuntimeError):
    """Another rank is gone (its process exited): nothing can run until the LLM is restarted."""


def broadcast_commands(commands: list[RankCommand] | None) -> list[RankCommand]:
    """Rank 0's ``commands`` on every rank (the others pass ``None``). Most steps have none: then
    only their count (zero) crosses, one small broadcast."""
    data = None
    if commands is not None:
        data = json.dumps([cmd.to_json(c) for c in commands]).encode() if commands else b""
    received = broadcast_bytes(data)
    return [cmd.from_json(c) for c in json.loads(received)] if received else []


_PARAM_FIELDS = tuple(field.name for field in dataclasses.fields(SamplingParams))


def request_to_json(request: LlmRequest) -> dict:
    """What another rank needs to run ``request`` from its start (its sampling parameters'
    fields as they are: plain values, encoded at once)."""
    params = request.sampling_params
    return {
        "request_id": request.request_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        "max_new_tokens": request.max_new_tokens,
        "sampling_params": {name: getattr(params, name) for name in _PARAM_FIELDS}
        | {"guided_decoding": guide.to_json() if (guide := params.guided_decoding) else None},
        "end_ids": list(request.end_ids),
        "bad_word_ids": [list(word) for word in request.bad_word_ids],
        "cache_salt": request.cache_salt,
        "context_only": request.context_only,
        "images": images_to_json(request.multimodal),
    }


def request_from_json(data: dict) -> LlmRequest:
    params = dict(data["sampling_params"])
    if params["logit_bias"] is not None:  # JSON object keys are strings
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    return LlmRequest(
        request_id=data["request_id"],
        prompt_token_ids=data["prompt_token_ids"],
        max_new_tokens=data["max_new_tokens"],
        sampling_params=SamplingParams(**params),
        end_ids=tuple(data["end_ids"]),
        bad_word_ids=tuple(tuple(word) for word in data["bad_word_ids"]),
        cache_salt=data["cache_salt"],
        context_only=data["context_only"],
        multimodal=images_from_json(data.get("images")),
    )


def _request_for_ranks(request: LlmRequest) -> dict:
    """``request_to_json``, with the seed rank 0 drew for a sampled request that has none, so
    that every rank draws the same tokens."""
    data = request_to_json(request)
    if not request.sampling_params.greedy:
        data["sampling_params"]["seed"] = request.seed
    return data


def submit_command(request: LlmRequest, rank: int) -> SubmitCommand:
    return SubmitCommand(rank, _request_for_ranks(request))


def generation_only_command(
    request: LlmRequest, handle: TransferHandle, rank: int
) -> GenerationOnlyCommand:
    """What another rank needs to start ``request`` (resumed from a context server) there."""
    return GenerationOnlyCommand(
        rank,
        _request_for_ranks(request),
        list(request.output_token_ids),
        list(request.py_draft_tokens),
        handle.model_dump(mode="json"),
    )


def start_generation_only(
    executor: PyExecutor,
    transceiver: KvCacheTransceiver,
    mapping: Mapping,
    command: GenerationOnlyCommand,
) -> LlmRequest:
    """A follower's side of ``generation_only_command`` (rank 0 checked the request and its
    signature). A request that cannot start ends with ``FinishReason.ERROR``."""
    request = request_from_json(command.request)
    request.output_token_ids = list(command.output_token_ids)
    request.py_draft_tokens = list(command.draft_tokens)
    request.num_sampling_steps = 1  # as rank 0's (``generation_only.resume_from_context``)
    try:
        handle = TransferHandle.model_validate(command.handle)
        load_kv = PromptKvPull(executor, transceiver, handle, **pull_options(mapping))
        executor.enqueue_generation_only(request, load_kv)
    except ValueError as exc:
        if not request.is_finished:
            request.fail(ErrorKind.INVALID_REQUEST, str(exc))
    return request


def send_step_commands(commands: list[RankCommand], lost: Callable[[], str | None]) -> None:
    """Rank 0's broadcast at the start of a step; ``RanksLostError`` when a rank is gone (checked
    first, and any failure of the broadcast itself), so that no step waits on a dead rank."""
    reason = lost()
    if reason is not None:
        raise RanksLostError(reason)
    try:
        broadcast_commands(commands)
    except RuntimeError as exc:
        raise RanksLostError(lost() or f"the other ranks stopped answering: {exc}") from exc


class TensorParallelLeader:
    """Rank 0's side under tensor parallelism: ``PyExecutor`` records its submits and cancels here
    and calls ``start_step`` first thing in every step. ``lost()`` names a rank whose process is
    gone (None while all live)."""

    def __init__(self, lost: Callable[[], str | None]) -> None:
        self._lost = lost
        self._outbox: list[RankCommand] = []

    def submitted(self, request: LlmRequest) -> None:
        self._outbox.append(submit_command(request, EVERY_RANK))

    def submitted_generation_only(self, request: LlmRequest, handle: TransferHandle) -> None:
        self._outbox.append(generation_only_command(request, handle, EVERY_RANK))

    def cancelled(self, request_id: int) -> None:
        self._outbox.append(CancelCommand(EVERY_RANK, request_id))

    def released(self, request_ids: list[int]) -> None:
        self._outbox.append(ReleaseCommand(list(request_ids)))

    def start_step(self) -> None:
        commands, self._outbox = self._outbox, []
        send_step_commands(commands, self._lost)


def stop_followers(lost: Callable[[], str | None]) -> None:
    """Rank 0's last command: the other ranks leave their loops (unless one is gone already)."""
    if lost() is None:
        broadcast_commands([ShutdownCommand()])


def apply_commands(
    executor: PyExecutor,
    commands: list[RankCommand],
    mapping: Mapping,
    transceiver: KvCacheTransceiver | None = None,
) -> list[LlmRequest] | None:
    """Apply rank 0's commands meant for ``mapping.rank``; returns the requests they started
    here, None at shutdown."""
    started = []
    for command in commands:
        if isinstance(command, ShutdownCommand):
            return None
        if not cmd.is_for(command, mapping.rank):
            continue
        match command:
            case SubmitCommand(request=data):
                started.append(request_from_json(data))
                executor.enqueue_request(started[-1])
            case CancelCommand(request_id=request_id):
                executor.cancel_request(request_id)
            case GenerationOnlyCommand():
                started.append(start_generation_only(executor, transceiver, mapping, command))
            case ReleaseCommand(request_ids=ids):  # rank 0 decided: pulled, or timed out there
                executor.release_transferred(ids, transceiver.revoke, expire=False)
    return started


def step_quietly(executor: PyExecutor) -> None:
    """One step of a follower: a step that fails has ended its batch (as on rank 0); the follower
    logs it and goes on, so the ranks stay together."""
    if not executor.has_work and executor.model_engine.exchange is None:
        return  # (where the MoE layers exchange tokens, every rank steps)
    try:
        executor.step()
    except Exception:
        logger.error("step failed on this rank:\n%s", traceback.format_exc())


class StepReporter(Protocol):
    """What a follower tells rank 0 of each step (attention DP: ``ProgressReporter``)."""

    def before_step(self, started: list[LlmRequest]) -> None: ...

    def after_step(self) -> None: ...


def follow(
    executor: PyExecutor,
    mapping: Mapping,
    reporter: StepReporter | None = None,
    transceiver: KvCacheTransceiver | None = None,
) -> None:
    """A follower rank's loop: receive rank 0's commands, step, (under attention DP) report back;
    returns when rank 0 shuts down."""
    while (
        started := apply_commands(executor, broadcast_commands(None), mapping, transceiver)
    ) is not None:
        if reporter is not None:
            reporter.before_step(started)
        step_quietly(executor)
        if reporter is not None:
            reporter.after_step()
