"""GuidedDecoder: the requests' grammars, from submission to the mask rows of each step.

A request with ``guided_decoding`` waits (``WAITING_FOR_GRAMMAR``, passed over by the scheduler,
never blocking the requests behind it) while its grammar compiles on the compiler's thread; once
compiled it gets a matcher and joins the queue (``poll``). A grammar that cannot be built, or
takes longer than ``COMPILE_TIMEOUT_S``, ends its request with an error naming it.

Each step the host fills one mask row per logits row (``fill``; one batched xgrammar call per
position, ``GrammarCompiler.fill_rows``): a row's first position from the matcher's state after
the tokens the request has, then one position per draft, the matcher advanced through the drafts
the grammar allows and rolled back afterwards. A draft the grammar refuses is refused by its own
position's mask too (the target cannot accept it), so the rows after it are never read; they,
and the rows of requests without a grammar, allow everything. The matcher takes the tokens a
request emitted since its last step as the next is filled. A constraint that no token of the
vocabulary can continue (a character the tokenizer cannot write) ends its request with an error,
never a row that allows nothing. Under speculation the drafter's proposals are masked by the
same grammars (``drafting``, ``draft_guide``), so that the target accepts them.

Under the overlap scheduler a request with a grammar is fed from the device like any other: its
next step's first part (the forward) is queued, then the step before is read and the masks
filled from its tokens, then the second part (``StepDispatch.launch``'s ``settle``). In CUDA
graphs, the mask rows are an input of the extras buckets (``step_inputs.bucket_inputs``); a step
that finishes a prompt beside a grammar runs eagerly (``GraphShapes.shape``).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tensorrt_llm._torch.pyexecutor.draft_guide import DraftGuide
from tensorrt_llm._torch.pyexecutor.grammar_matcher import (
    COMPILE_TIMEOUT_S,
    GrammarCompiler,
    Pending,
)
from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, LlmRequest, LlmRequestState
from tensorrt_llm.logger import plain_message
from tensorrt_llm.runtime.staging import PinnedStaging
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParamsError


@dataclass
class _Guide:
    matcher: object  # xgrammar.GrammarMatcher
    consumed: int = 0  # the request's output tokens the matcher has taken


class GuidedDecoder:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.words = math.ceil(compiler.vocab_size / 32)  # int32 words of a mask row
        self._pending: dict[int, tuple[LlmRequest, Pending]] = {}
        self._guides: dict[int, _Guide] = {}
        self._dead: list[LlmRequest] = []  # ended by ``fill``, freed after ``poll``
        self.fill_seconds = 0.0  # the host's time in ``fill`` (benchmarks/bench_decode.py)
        self._draft_staging = PinnedStaging()  # (the drafts' masks)

    def submit(self, request: LlmRequest, beside: bool = False) -> None:
        """Start compiling ``request``'s grammar; it waits for it in the queue. ``beside``: its
        state is left alone (a generation-only request, whose prompt's KV is pulled meanwhile:
        ``hold`` it if it is ready to join the batch before its grammar)."""
        guide = request.sampling_params.guided_decoding
        if guide is None:
            return
        pending = Pending(self.compiler.submit(guide))
        if not beside:
            request.state = LlmRequestState.WAITING_FOR_GRAMMAR
            pending.resume = LlmRequestState.CONTEXT_INIT
        self._pending[request.request_id] = (request, pending)

    def prepare(self, guide: GuidedDecodingParams) -> Future:
        """Start compiling ``guide`` ahead of a request that carries it (the request then finds it
        compiled: a grammar is built once). A future done once it is compiled; its exception, a
        ``SamplingParamsError`` naming ``guided_decoding``, says why it cannot be used. On the
        engine loop's thread (it shares the compiler's cache with ``submit``)."""
        checked: Future = Future()

        def settle(compiled: Future) -> None:
            error = compiled.exception()
            if error is None:
                checked.set_result(None)
            else:
                reason = plain_message(error, "compiling a grammar")
                message = f"GuidedDecodingParams.{guide.kind}: {reason}"
                checked.set_exception(SamplingParamsError("guided_decoding", message))

        self.compiler.submit(guide).add_done_callback(settle)
        return checked

    def submit_now(self, request: LlmRequest) -> None:
        """Compile ``request``'s grammar now, its state untouched: ranks that run in step under
        tensor parallelism (a grammar ready on one rank and not on another would split their
        schedules). A grammar that cannot be built is a ``ValueError``."""
        guide = request.sampling_params.guided_decoding
        if guide is None:
            return
        try:
            compiled = self.compiler.submit(guide).result(timeout=COMPILE_TIMEOUT_S)
        except Exception as exc:
            raise ValueError(_cannot_use(guide.kind, exc)) from None
        self._guides[request.request_id] = _Guide(self._matcher(request, compiled))

    def hold(self, request: LlmRequest) -> None:
        """``request`` (``submit``'s ``beside``) would join the batch now: while its grammar
        still compiles it waits, and then goes on in the state it had."""
        pending = self._pending.get(request.request_id)
        if pending is not None:
            pending[1].resume = request.state
            request.state = LlmRequestState.WAITING_FOR_GRAMMAR

    @property
    def compiling(self) -> bool:
        return bool(self._pending)

    def guided(self, request: LlmRequest) -> bool:
        return request.request_id in self._guides

    @property
    def active(self) -> bool:
        """Some request has a grammar (else a step has nothing to look up)."""
        return bool(self._guides)

    def poll(self) -> list[LlmRequest]:
        """Requests whose grammar is ready join the queue; returns those that ended with an
        error: their grammar failed, or (in an earlier ``fill``) it allowed no token at all."""
        failed, self._dead = self._dead, []
        for request_id, (request, pending) in list(self._pending.items()):
            future = pending.future
            if not future.done() and not pending.timed_out:
                continue
            error = future.exception() if future.done() else TimeoutError("compiling took too long")
            if error is not None and pending.resume is None:
                continue  # (a request loading its KV: it ends once it joins, ``hold``)
            del self._pending[request_id]
            if request.is_finished:  # (cancelled while it waited)
                continue
            if error is not None:
                kind = request.sampling_params.guided_decoding.kind
                request.fail(ErrorKind.INVALID_REQUEST, _cannot_use(kind, error))
                failed.append(request)
                continue
            self._guides[request_id] = _Guide(self._matcher(request, future.result()))
            if request.state is LlmRequestState.WAITING_FOR_GRAMMAR:
                request.state = pending.resume
        return failed

    def fill(self, requests: list[LlmRequest], width: int) -> torch.Tensor | None:
        """``[len(requests) * width, words]`` int32 mask rows for a step's rows (``requests`` in
        row order, ``width`` positions each); None when no request has a grammar."""
        if not self._guides or not any(r.request_id in self._guides for r in requests):
            return None
        start = time.perf_counter()
        try:
            return self._fill(requests, width)
        finally:
            self.fill_seconds += time.perf_counter() - start

    def drafting(
        self, requests: list[LlmRequest | None], device: torch.device
    ) -> DraftGuide | None:
        """The masks of a step's draft chain (``draft_guide``) for its first rows, ``requests``
        in row order (None: a padding row), after this step's ``fill``; None when no row has a
        grammar."""
        if not self._guides:
            return None
        guides = [None if r is None else self._guides.get(r.request_id) for r in requests]
        if not any(guides):
            return None
        matchers = [None if g is None else g.matcher for g in guides]
        return DraftGuide(
            matchers, self.compiler.fill_rows, self.words, device, self._draft_staging
        )

    def _fill(self, requests: list[LlmRequest], width: int) -> torch.Tensor:
        """Depth by depth: every guided row's first position in one batched fill
        (``fill_rows``), then each draft position of the requests whose matcher took the draft
        before it, then the drafts rolled back."""
        mask = torch.full((len(requests) * width, self.words), -1, dtype=torch.int32)
        level: list[tuple[LlmRequest, _Guide, int]] = []
        for r, request in enumerate(requests):
            guide = self._guides.get(request.request_id)
            if guide is None:
                continue
            _catch_up(request, guide)
            if not guide.matcher.is_terminated():
                level.append((request, guide, r * width))
        if not level:
            return mask
        self._batch_fill(mask, level, 0)
        rows = torch.tensor([row for _, _, row in level])
        dead = set((~mask[rows].any(dim=1)).nonzero().flatten().tolist())
        for i in dead:
            request, _, row = level[i]  # no token of the vocabulary goes on: it ends (``poll``)
            request.fail(
                ErrorKind.INVALID_REQUEST,
                "guided_decoding: no token of this model's vocabulary can continue the "
                f"{request.sampling_params.guided_decoding.kind} constraint here",
            )
            self._dead.append(request)
            mask[row : row + width] = -1
        level = [entry for i, entry in enumerate(level) if i not in dead]
        taken = [0] * len(level)  # the drafts each matcher took, rolled back at the end
        live = list(range(len(level)))
        for depth in range(1, width):
            deeper = []
            for i in live:
                request, guide, _ = level[i]
                drafts = request.py_draft_tokens
                if depth > len(drafts) or not guide.matcher.accept_token(drafts[depth - 1]):
                    continue
                taken[i] += 1
                if not guide.matcher.is_terminated():
                    deeper.append(i)
            if deeper:
                self._batch_fill(mask, [level[i] for i in deeper], depth)
            live = deeper
        for (_, guide, _), n in zip(level, taken, strict=True):
            if n:
                guide.matcher.rollback(n)
        return mask

    def _batch_fill(self, mask: torch.Tensor, level: list, depth: int) -> None:
        """The mask rows at ``depth`` of ``level``'s requests from their matchers' states."""
        self.compiler.fill_rows(
            [guide.matcher for _, guide, _ in level], mask, [row + depth for _, _, row in level]
        )

    def _matcher(self, request: LlmRequest, compiled):
        """A matcher that ends at the request's end and stop tokens (with ``ignore_eos`` too: the
        grammar ends there, and the request goes on unconstrained)."""
        stops = sorted({*request.end_ids, *request.sampling_params.stop_token_ids})
        return self.compiler.matcher(compiled, stops or None)

    def forget(self, request: LlmRequest) -> None:
        self._pending.pop(request.request_id, None)
        self._guides.pop(request.request_id, None)


def _catch_up(request: LlmRequest, guide: _Guide) -> None:
    """The tokens ``request`` emitted since into its matcher (a generation-only request's first
    one came from the context server). Each was sampled under the grammar's mask, so a refusal
    is the engine's fault: the step fails (and its requests are retried one at a time)."""
    tokens = request.output_token_ids
    for token in tokens[guide.consumed :]:
        if guide.matcher.is_terminated():
            break
        if not guide.matcher.accept_token(token):
            raise RuntimeError(
                f"request {request.request_id}: its grammar refuses token {token}, which it emitted"
            )
    guide.consumed = len(tokens)


def _cannot_use(kind: str, error: BaseException) -> str:
    reason = plain_message(error, "compiling a grammar")
    return f"guided_decoding: the {kind} constraint cannot be used: {reason}"
