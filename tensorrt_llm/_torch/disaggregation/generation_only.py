"""The generation server's end of a disaggregated request: resume after the context server.

A generation-only request starts at its first generation step. Its first token and drafts come
from the context server's ``DisaggregatedParams``; its prompt KV is loaded when the executor admits
it (``PyExecutor.enqueue_generation_only``; ``DisaggCoordinator.progress`` advances the
``PromptKvPull`` between steps): slots are allocated in every KV manager, then the blocks this
server's prefix cache does not already hold are pulled over NIXL. No prefill runs.

    prompt blocks:  [0 .......... reused // tpb) [reused // tpb ........ ceil(prompt_len / tpb))
                     from the local prefix cache   pulled from the context server's slots
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.params import (
    DisaggregatedParams,
    RequestType,
    TransferHandle,
)
from tensorrt_llm._torch.disaggregation.pulls import ReplayedHandleError, drive
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.multimodal import MultimodalInput

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
    from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor

_RESUMABLE = (RequestType.CONTEXT_ONLY, RequestType.GENERATION_ONLY)
# a rank's state in a load's agreement; a failed one's is {"error": ..., "replayed": bool}
_PULLING, _DONE = "pulling", "done"
_GOING = (_PULLING, _DONE)


def check_resumable(params: DisaggregatedParams) -> TransferHandle:
    """The handle of a context server's ``context_only`` reply (sent on as ``generation_only``);
    a ``ValueError`` naming the request type for anything else."""
    if params.request_type not in _RESUMABLE or not params.has_handle:
        raise ValueError(
            f"disaggregated_params.request_type={params.request_type.value!r}: expected a context "
            "server's 'context_only' result (sent as 'generation_only')"
        )
    return params.transfer_handle


def resume_from_context(
    request: LlmRequest,
    params: DisaggregatedParams,
    executor: PyExecutor,
    transceiver: KvCacheTransceiver,
    **pull_options,
) -> PromptKvPull:
    """Give ``request`` (made from ``params.prompt_token_ids``) the context server's first token
    and drafts; returns the ``load_kv`` to hand to ``PyExecutor.enqueue_generation_only``
    (``pull_options``: ``PromptKvPull``'s, for a server of several ranks).
    ``trust.UntrustedParamsError`` unless a context server of this deployment signed ``params``."""
    handle = check_resumable(params)
    trust.verify(params, transceiver.secret)
    _check_tokens(params, executor)
    if request.prompt_token_ids != params.prompt_token_ids:
        raise ValueError(
            f"request {request.request_id}: its prompt is not disaggregated_params.prompt_token_ids"
        )
    _take_images(request, params)
    request.output_token_ids = [params.first_token]
    request.py_draft_tokens = list(params.draft_tokens)
    request.num_sampling_steps = 1  # the context server's step drew the first token
    return PromptKvPull(executor, transceiver, handle, **pull_options)


def _take_images(request: LlmRequest, params: DisaggregatedParams) -> None:
    """The prompt's images as the context server saw them (``params.images``): the request's own
    must be the same ones; a request made from token ids alone takes them, so that its blocks are
    keyed by the images' digests as the context server's are."""
    refs = [(r.offset, r.num_tokens, r.digest) for r in params.images or []]
    if request.multimodal is not None:
        if request.multimodal.refs() != refs:
            raise ValueError(
                f"request {request.request_id}: its images are not the ones the context server "
                "prefilled (disaggregated_params.images)"
            )
        return
    if any(offset + n > request.prompt_len for offset, n, _ in refs):
        raise ValueError(
            f"request {request.request_id}: disaggregated_params.images past its prompt"
        )
    if refs:
        request.multimodal = MultimodalInput.from_refs(refs)
        request.prompt_key_ids = request.multimodal.key_tokens(request.prompt_token_ids)


def _check_tokens(params: DisaggregatedParams, executor: PyExecutor) -> None:
    """The first token and drafts must be ids of this model and at most ``max_draft_len`` drafts:
    a bad one fails this request here, before it can join (and fail) a batch."""
    vocab = executor.model_engine.model.config.vocab_size
    bad = [t for t in (params.first_token, *params.draft_tokens) if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"disaggregated_params: first_token and draft_tokens must be in [0, {vocab}); "
            f"got {bad[:5]}"
        )
    worker = executor.spec_worker
    max_drafts = worker.max_draft_len if worker is not None else 0
    if len(params.draft_tokens) > max_drafts:
        raise ValueError(
            f"disaggregated_params.draft_tokens has {len(params.draft_tokens)} tokens; this server "
            f"verifies at most max_draft_len={max_drafts}"
        )


class KvPullFailed(RuntimeError):
    """A rank of a tensor-parallel server could not pull its part of the KV."""


@dataclass(frozen=True)
class PromptKvPull:
    """The ``LoadKv`` of one generation-only request: allocates its prompt's slots, pulls the
    blocks not reused locally and returns the prompt tokens it did not compute (all of them). On
    an error the executor frees whatever was allocated.

    On a tensor-parallel server every rank pulls its heads, and the ranks ``agree`` at every
    step of the load (each rank's state gathered: still pulling, done, or its error), so that
    they all see the same step end it: one rank's failure fails the request on all of them, and
    only the ``leader`` (rank 0) tells the context server it pulled or gave up."""

    executor: PyExecutor
    transceiver: KvCacheTransceiver
    handle: TransferHandle
    agree: Callable[[str | None], list[str | None]] | None = None
    leader: bool = True

    def __call__(self, request: LlmRequest) -> int:
        """The whole load, waited for here."""
        return drive(self.steps(request))

    def steps(self, request: LlmRequest) -> Generator[None, None, int]:
        """The load as steps: yields while its transfers are in flight. Raises
        ``ReplayedHandleError`` for a handle pulled here before, else what failed."""
        if self.agree is None:
            return (yield from self._load(request, confirm=True))
        pulling = self._load(request, confirm=False)
        try:
            return (yield from self._agreed(request, pulling))
        finally:
            pulling.close()  # (given up: its transfers released, or parked until they end)

    def _agreed(self, request: LlmRequest, pulling) -> Generator[None, None, int]:
        state, loaded = _PULLING, 0
        while True:  # one agreement per step, on every rank
            if state == _PULLING:
                try:
                    next(pulling)
                except StopIteration as end:
                    state, loaded = _DONE, end.value
                except Exception as exc:  # the ranks must meet whatever happened
                    replayed = isinstance(exc, ReplayedHandleError)
                    state = {"error": f"{type(exc).__name__}: {exc}", "replayed": replayed}
            states = self.agree(state)
            failed = [(r, s) for r, s in enumerate(states) if s not in _GOING]
            if failed:
                error = (
                    ReplayedHandleError if all(s["replayed"] for _, s in failed) else KvPullFailed
                )
                ranks = "; ".join(f"rank {r}: {s['error']}" for r, s in failed)
                raise error(f"request {request.request_id}: KV pull failed on {ranks}")
            if all(s == _DONE for s in states):
                if self.leader:
                    self.transceiver.confirm(self.handle)
                return loaded
            yield

    def _load(self, request: LlmRequest, confirm: bool) -> Generator[None, None, int]:
        self.transceiver.check_peer(self.handle)  # before any slot is taken
        reused = self._allocate(request)
        tokens_per_block = self.executor.kv_cache_manager.tokens_per_block
        yield from self.transceiver.pull_steps(
            request.request_id,
            self.handle,
            num_blocks=math.ceil(request.prompt_len / tokens_per_block),
            start_block=reused // tokens_per_block,
            timeout_s=self.executor.disagg.transfer_timeout_s,
            confirm=confirm,
        )
        return request.prompt_len - reused

    def settled(self, request: LlmRequest) -> bool:
        """Whether no READ given up for this pull still writes into ``request``'s slots."""
        return self.transceiver.settle(request.request_id)

    def abandon(self) -> None:
        """This request will not pull (it was cancelled, refused or failed first): tell the
        context server, which frees its hold now rather than at its timeout."""
        if self.leader:
            self.transceiver.release(self.handle)

    def _allocate(self, request: LlmRequest) -> int:
        """Slots for the whole prompt in every KV manager; returns the prompt tokens the target's
        prefix cache already held (``request.num_reused_tokens``)."""
        target = self.executor.kv_cache_manager
        reused = 0
        for manager in self.executor.resource_manager.kv_cache_managers.values():
            got = manager.add_sequence(
                request.request_id, request.prompt_key_ids, request.cache_salt
            )
            reused = got if manager is target else reused
            if not manager.resize_sequence(request.request_id, request.prompt_len):
                raise ValueError(
                    f"request {request.request_id}: no KV slots for its "
                    f"{request.prompt_len}-token prompt"
                )
        request.num_reused_tokens = reused
        return reused
