"""A step whose forward and sampling are queued on the device, read by the host later.

With the overlap scheduler the executor launches step n+1 before it reads step n: the host
schedules and prepares n+1 while n runs. The requests of n that go on in n+1 take their inputs
from n's tokens on the device (``TokenFeed``), never from the host. Their positions are known on
the host when each adds exactly one token (target-only decoding); with Eagle3 they are moved on
the device by each row's accepted count, which only the CUDA graph step does.

Reading a step (``LaunchedStep.read``) waits for its copy to the host (an event recorded after
the copy was queued) and gives its ``StepTokens``; ``apply_tokens`` emits them to the requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tensorrt_llm._torch.pyexecutor.executor import ExecutorStats
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.token_feed import TokenFeed
from tensorrt_llm._torch.speculative.interface import StepTokens


@dataclass
class DeviceTokens:
    """A step's tokens on the device. Row ``i`` is the ``i``-th request of ``rows`` (batch
    indices; None: a graph bucket's padding row, nobody's): ``tokens[i, : num_accepted[i] + 1]``
    are its new tokens (target-only: one, and no ``num_accepted``), ``drafts[i]`` its next drafts
    (Eagle3)."""

    rows: list[int | None]  # batch index per row
    tokens: torch.Tensor  # [n, T] long
    num_accepted: torch.Tensor | None = None  # [n]
    drafts: torch.Tensor | None = None  # [n, K]
    # each token's logprob [n, T] and the ``top`` most likely [n, T, top] (values, ids), computed
    # on the device from the step's logits (``step_program.token_logprobs``)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def feed(self, batch: ScheduledRequests) -> TokenFeed:
        requests = batch.all_requests
        ids = {requests[i].request_id: r for r, i in enumerate(self.rows) if i is not None}
        if self.num_accepted is None:
            ones = torch.ones(len(self.rows), dtype=torch.long, device=self.tokens.device)
            return TokenFeed(ids, self.tokens[:, -1:], ones, 1)
        last = self.tokens.gather(1, self.num_accepted[:, None])
        return TokenFeed(
            ids,
            torch.cat([last, self.drafts], dim=1),
            self.num_accepted + 1,
            self.tokens.shape[1],
        )

    def to_host(self) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Everything on the host in one copy per dtype (the integers, then any logprobs), queued
        now; the event marks their end (CUDA)."""
        ints = [self.tokens.flatten()]
        if self.num_accepted is not None:
            ints += [self.num_accepted, self.drafts.flatten()]
        packed = [torch.cat(ints)]
        if self.logprobs is not None:
            chosen, values, ids = self.logprobs
            packed[0] = torch.cat([packed[0], ids.flatten()])
            packed.append(torch.cat([chosen.flatten(), values.flatten()]))
        if packed[0].device.type != "cuda":
            return [t.cpu() for t in packed], None
        host = [t.to("cpu", non_blocking=True) for t in packed]  # pinned: the copies do not block
        event = torch.cuda.Event()
        event.record()
        return host, event

    def host_logprobs(self, host: list[torch.Tensor]) -> dict[int, list[tuple]]:
        """Per batch index: per token position, (its logprob, [(id, logprob)] of the top)."""
        n, width = self.tokens.shape
        _, values, _ = self.logprobs
        top = values.shape[-1]
        ints = host[0].tolist()
        ids = ints[len(ints) - n * width * top :]
        floats = host[1].tolist()
        chosen, values = floats[: n * width], floats[n * width :]
        out = {}
        for r, i in enumerate(self.rows):
            if i is None:
                continue
            out[i] = []
            for j in range(r * width, (r + 1) * width):
                pairs = zip(
                    ids[j * top : (j + 1) * top], values[j * top : (j + 1) * top], strict=True
                )
                out[i].append((chosen[j], list(pairs)))
        return out

    def step_tokens(self, host: list[torch.Tensor], num_requests: int) -> StepTokens:
        n, width = self.tokens.shape
        values = host[0].tolist()
        tokens = [values[i * width : (i + 1) * width] for i in range(n)]
        new_tokens: list[list[int]] = [[] for _ in range(num_requests)]
        next_drafts: list[list[int]] = [[] for _ in range(num_requests)]
        accepted: list[int | None] = [None] * num_requests
        if self.num_accepted is None:
            for i, row in zip(self.rows, tokens, strict=True):
                if i is not None:
                    new_tokens[i] = row
            return StepTokens(new_tokens, next_drafts, accepted)
        counts = values[n * width : n * width + n]
        k = self.drafts.shape[1]
        flat = values[n * width + n :]
        for r, i in enumerate(self.rows):
            if i is None:
                continue
            new_tokens[i] = tokens[r][: counts[r] + 1]
            next_drafts[i] = flat[r * k : (r + 1) * k]
            accepted[i] = counts[r]
        return StepTokens(new_tokens, next_drafts, accepted)


@dataclass
class LaunchedStep:
    """A scheduled batch whose step is queued: its logits rows, its tokens on the device, and
    what waits for it to be read."""

    batch: ScheduledRequests
    decoding: list[bool]  # per request: a generation step (its acceptance counts)
    logits: torch.Tensor  # [n * T, V]: each row's positions (``step_inputs``)
    device_tokens: DeviceTokens
    host_tokens: StepTokens | None = field(init=False, default=None)  # once read
    # the next step may launch before this one is read (its logits stay valid, its tokens feed)
    overlappable: bool = False
    # requests that ended while the step ran: freed once it is read (the device may still write
    # their KV until then)
    deferred: list[LlmRequest] = field(default_factory=list)
    # per batch index, per token position: (logprob, top list), from the device (see DeviceTokens)
    logprobs: dict[int, list[tuple]] | None = None
    _host: list[torch.Tensor] | None = None
    _event: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        self._host, self._event = self.device_tokens.to_host()

    def row_logits(self, index: int) -> torch.Tensor | None:
        """``[T, V]`` the logits of the batch's ``index``-th request's row (None: it has none)."""
        rows = self.device_tokens.rows
        if index not in rows:
            return None
        return self.logits.view(len(rows), -1, self.logits.shape[-1])[rows.index(index)]

    def holds(self, request: LlmRequest) -> bool:
        return any(r is request for r in self.batch.all_requests)

    @property
    def all_finished(self) -> bool:
        return all(r.is_finished for r in self.batch.all_requests)

    def feed(self) -> TokenFeed:
        return self.device_tokens.feed(self.batch)

    def read(self) -> StepTokens:
        """The step's tokens on the host (waits for the copy)."""
        if self.host_tokens is None:
            if self._event is not None:
                self._event.synchronize()
            self.host_tokens = self.device_tokens.step_tokens(self._host, self.batch.batch_size)
            if self.device_tokens.logprobs is not None:
                self.logprobs = self.device_tokens.host_logprobs(self._host)
        return self.host_tokens


@dataclass
class LaunchingBatch:
    """A batch whose step is being queued: between its two parts the steps before it may be read
    (``StepDispatch.launch``'s ``settle``); its requests that end then are freed once its step
    is read, as a launched step's are."""

    batch: ScheduledRequests
    deferred: list[LlmRequest] = field(default_factory=list)

    def holds(self, request: LlmRequest) -> bool:
        return any(r is request for r in self.batch.all_requests)


def apply_tokens(
    step: LaunchedStep,
    tokens: StepTokens,
    live: list[LlmRequest],
    stats: ExecutorStats,
    max_seq_len: int,
) -> None:
    """Emit a read step's tokens to its ``live`` requests (not those ended while it ran): each
    token in turn until one ends the request, with its logprobs and logits where asked; then the
    acceptance counts and the next drafts."""
    for i, req in enumerate(step.batch.all_requests):
        new = tokens.new_tokens[i]
        if not new or req not in live:
            continue
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        params = req.sampling_params
        top, logprobs = params.logprobs, None
        if top is not None:  # computed on the device: this request's top of them
            logprobs = [(lp, pairs[:top]) for lp, pairs in step.logprobs[i][: len(new)]]
        rows = step.row_logits(i) if params.return_generation_logits else None
        emitted = 0
        for j, token in enumerate(new):
            if rows is not None:
                req.py_generation_logits.append(rows[j].cpu())
            if logprobs is not None:
                req.py_logprobs.append(logprobs[j])
            req.output_token_ids.append(token)
            emitted += 1
            stats.num_generated_tokens += 1
            check_stop(req, token, max_seq_len)
            if req.is_finished:
                break
        if step.decoding[i]:  # AL counts the accepted drafts that were emitted, not those cut off
            accepted = min(tokens.num_accepted[i] or 0, emitted - 1)
            req.num_decode_iterations += 1
            req.num_accepted_draft_tokens += accepted
            stats.num_decode_iterations += 1
            stats.num_accepted_draft_tokens += accepted
        req.py_draft_tokens = [] if req.is_finished else tokens.next_drafts[i]
        if req.context_only and not req.is_finished:
            req.finish(FinishReason.CONTEXT_DONE)


def check_stop(req: LlmRequest, token: int, max_seq_len: int) -> None:
    """The token-level ends: an end or stop token, the length. Stop strings are the output side's
    (the detokenizer, above this package), which ends a request through ``finish_request``."""
    params = req.sampling_params
    if token in req.end_ids and not params.ignore_eos or token in params.stop_token_ids:
        req.finish(FinishReason.STOP, token)
    elif len(req.output_token_ids) >= req.max_new_tokens or req.get_num_tokens() >= max_seq_len:
        req.finish(FinishReason.LENGTH)
