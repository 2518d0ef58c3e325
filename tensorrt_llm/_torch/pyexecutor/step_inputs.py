"""StepInputs: every device tensor a step reads, laid out the same way for eager steps and CUDA
graph buckets, filled from the host through pinned staging (one copy per dtype).

A step's tokens are made by its **rows**, in batch order: each prompt that finishes in the step
(one token, nothing to verify), then each generation request (its last token and its drafts).
Every row has ``T = 1 + K`` positions (``K``: the drafts a step verifies, 0 without speculation);
position ``j`` is the logits row that predicts the token after the row's ``j``-th draft (a prompt's
positions all repeat its last token's row, and only the first is used). So the step's logits are
``[n * T, V]`` in row order, and penalties, sampling, acceptance and logprobs read them alike
whether the step was scheduled eagerly or replayed from a graph (``step_program.py``).

Per row the host gives the sampling values (temperature, top-k, top-p, seed, counter), the
``DraftProbStore`` slot behind a sampled row's drafts, and the ``LogitsState`` slot and penalties
of a row with penalties or bias (``RowLayout`` says which of them the step carries). Padded rows
of a graph bucket get values that make them greedy and point them at the scratch slots.

An eager step's inputs are new tensors each step (``StepInputsBuilder``); a graph bucket's are
views into tensors it owns for its life (``bucket_inputs``), rewritten before each replay
(``write_bucket``), so the captured graph reads them where they were at capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampler import COUNTER_STRIDE, SamplingTensors, uses_top_k
from tensorrt_llm.runtime.staging import PinnedStaging
from tensorrt_llm.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.guided_decoder import GuidedDecoder
    from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
    from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore


@dataclass(frozen=True)
class RowLayout:
    """Which per-row values a step carries: sampling (top-k, seed, counter; temperature, top-p),
    the drafter's q slots (sampled Eagle3), penalties (a ``LogitsState`` slot; presence and
    frequency)."""

    sampled: bool = False
    q_slots: bool = False
    penalties: bool = False

    @property
    def num_ints(self) -> int:
        return 3 * self.sampled + self.q_slots + self.penalties

    @property
    def num_floats(self) -> int:
        return 2 * self.sampled + 2 * self.penalties


@dataclass
class PenaltyInputs:
    """Per row: its ``LogitsState`` slot (the scratch slot: none), presence and frequency."""

    slots: torch.Tensor  # [n] long
    presence: torch.Tensor  # [n] float32
    frequency: torch.Tensor  # [n] float32


@dataclass
class StepInputs:
    """What a step reads on the device (``n`` rows of ``T`` positions; see the module's note)."""

    input_ids: torch.Tensor  # [N] the step's tokens
    drafts: torch.Tensor  # [n, K] each row's drafts (target ids), the first ``num_drafts`` real
    num_drafts: torch.Tensor  # [n]
    rows: list[int]  # (host) each row's batch index
    # [n, T] the step token whose hidden state gives each position's logits (None: the step's
    # ``n * T`` tokens in order, a graph bucket's)
    token_index: torch.Tensor | None = None
    # [S] a graph bucket's first position of each sequence (its metadata is placed from them)
    first_positions: torch.Tensor | None = None
    # [S + 1] a mixed graph bucket's query offsets (a prompt's length changes from step to
    # step); None: every sequence is one row of ``T`` tokens
    cu_seqlens_q: torch.Tensor | None = None
    # [N] (eager Eagle3) the prompt's next token after each step token, where a prompt says it
    following: torch.Tensor | None = None
    num_prompts: int = 0  # the first rows that are prompts
    st: SamplingTensors | None = None  # None: every row greedy
    # [n] DraftProbStore slots (sampled rows' under speculation; every row's with relaxed acceptance)
    q_slots: torch.Tensor | None = None
    penalties: PenaltyInputs | None = None
    top_logprobs: int | None = None  # the top logprobs computed per token (None: none)
    request_ids: Sequence[int] = ()  # (host) each row's request (an eager draft chain's metadata)
    # [n * T, ceil(V / 32)] int32 the tokens each logits row allows (guided decoding; None: all)
    bitmask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.drafts.shape[0]

    @property
    def width(self) -> int:
        return self.drafts.shape[1] + 1

    @property
    def first_tokens(self) -> torch.Tensor:
        """``[n]`` the step token of each row's first position."""
        if self.token_index is not None:
            return self.token_index[:, 0]
        return torch.arange(self.num_rows, device=self.drafts.device) * self.width


def row_values(
    requests: Sequence[LlmRequest],
    pad: int,
    layout: RowLayout,
    logits_state: LogitsState | None,
    draft_probs: DraftProbStore | None,
) -> tuple[list[int], list[float]]:
    """The rows' values on the host, a column per value (``pad`` padded rows after the requests'):
    ints ``[top_k, seed, counter][q slot][penalty slot]``, floats ``[temperature, top_p]
    [presence, frequency]`` as ``layout`` has them. Slots are claimed here for requests that had
    none."""
    ints: list[int] = []
    floats: list[float] = []
    if layout.sampled:  # padded rows: greedy
        rows = [r.sampling_row for r in requests]
        ints += [row.top_k for row in rows] + [0] * pad
        ints += [row.seed for row in rows] + [0] * pad
        ints += [r.num_sampling_steps * COUNTER_STRIDE for r in requests] + [0] * pad
        floats += [row.temperature for row in rows] + [0.0] * pad
        floats += [row.top_p for row in rows] + [1.0] * pad
    if layout.q_slots:
        ints += draft_probs.slots(requests) + [draft_probs.scratch] * pad
    if layout.penalties:  # padded and plain rows: the scratch slot, no penalty
        ints += logits_state.slots(requests) + [logits_state.scratch] * pad
        for name in ("presence_penalty", "frequency_penalty"):
            floats += [float(getattr(r.sampling_params, name) or 0.0) for r in requests]
            floats += [0.0] * pad
    return ints, floats


def row_views(
    ints: torch.Tensor,
    floats: torch.Tensor,
    n: int,
    layout: RowLayout,
    all_greedy: bool = False,
    top_k: bool = True,
) -> tuple[SamplingTensors | None, torch.Tensor | None, PenaltyInputs | None]:
    """``row_values``' columns as device tensors: views of ``ints [num_ints * n]`` and ``floats
    [num_floats * n]``."""
    st = q_slots = penalties = None
    i = f = 0
    if layout.sampled:
        top, seed, counter = ints[: 3 * n].view(3, n)
        temperature, top_p = floats[: 2 * n].view(2, n)
        st = SamplingTensors(temperature, top, top_p, seed, counter, all_greedy, uses_top_k=top_k)
        i, f = 3 * n, 2 * n
    if layout.q_slots:
        q_slots = ints[i : i + n]
        i += n
    if layout.penalties:
        presence, frequency = floats[f : f + 2 * n].view(2, n)
        penalties = PenaltyInputs(ints[i : i + n], presence, frequency)
    return st, q_slots, penalties


def logprobs_top(requests: Sequence[LlmRequest]) -> int | None:
    """The most top logprobs any of ``requests`` asks for (0: each token's own), None when none
    asks for logprobs."""
    if all(r.sampling_params.logprobs is None for r in requests):
        return None
    return max(r.sampling_params.logprobs or 0 for r in requests)


class StepInputsBuilder:
    """An eager step's ``StepInputs`` from its batch: the rows found on the host, their values
    packed, and one copy per dtype through pinned staging."""

    def __init__(
        self,
        device: torch.device,
        max_draft_len: int,
        logits_state: LogitsState | None,
        draft_probs: DraftProbStore | None,
        guided: GuidedDecoder | None = None,
    ) -> None:
        """``guided``: the requests' grammars, whose mask rows the step applies."""
        self.device = device
        self.max_draft_len = max_draft_len
        self.logits_state = logits_state
        self.draft_probs = draft_probs
        self.guided = guided
        self._staging = (PinnedStaging(), PinnedStaging(), PinnedStaging())

    def build(
        self,
        batch: ScheduledRequests,
        input_ids: torch.Tensor,
        seq_lens: Sequence[int],
        masks: bool = True,
    ) -> StepInputs:
        """The rows of ``batch`` (whose step tokens are ``input_ids``, ``seq_lens`` per request
        in batch order); ``masks``: their grammars' masks too (else ``masks`` later)."""
        requests, num_contexts = batch.all_requests, len(batch.context_requests)
        k, spec = self.max_draft_len, self.draft_probs is not None
        width = k + 1
        starts = [0]
        for length in seq_lens:
            starts.append(starts[-1] + length)
        prompts = [i for i in range(num_contexts) if requests[i].is_last_context_chunk]
        rows = prompts + list(range(num_contexts, len(requests)))
        token_index, drafts, num_drafts = [], [], []
        for i in rows:
            start, end = starts[i], starts[i + 1]
            own = list(requests[i].py_draft_tokens) if i >= num_contexts else []
            drafts += own + [0] * (k - len(own))
            num_drafts.append(len(own))
            token_index += [
                min(start + j, end - 1) if i >= num_contexts else end - 1 for j in range(width)
            ]
        reqs = [requests[i] for i in rows]
        sampled = not all(r.sampling_params.greedy for r in reqs)
        layout = RowLayout(
            sampled=sampled,
            q_slots=spec and (sampled or self.draft_probs.phases is not None),
            penalties=any(r.sampling_params.processes_logits for r in reqs),
        )
        ints, floats = row_values(reqs, 0, layout, self.logits_state, self.draft_probs)
        following: list[int] = []
        if spec:  # what follows each step token where its prompt says
            for i, req in enumerate(requests):
                length = seq_lens[i]
                first = req.context_current_position + 1
                prompt = req.prompt_token_ids[first : first + length] if i < num_contexts else []
                following += prompt + [0] * (length - len(prompt))
        n = len(rows)
        host = torch.tensor(token_index + drafts + num_drafts + ints + following, dtype=torch.long)
        device_ints = self._staging[0].upload(torch.empty_like(host, device=self.device), host)
        device_floats = None
        if floats:
            values = torch.tensor(floats, dtype=torch.float32)
            device_floats = self._staging[1].upload(
                torch.empty_like(values, device=self.device), values
            )
        index, drafts_t, count, row_ints, after = device_ints.split(
            [n * width, n * k, n, len(ints), len(following)]
        )
        st, q_slots, penalties = row_views(
            row_ints, device_floats, n, layout, all_greedy=not sampled, top_k=uses_top_k(reqs)
        )
        mask = self.masks(reqs, width) if masks else None
        return StepInputs(
            input_ids=input_ids,
            drafts=drafts_t.view(n, k),
            num_drafts=count,
            rows=rows,
            token_index=index.view(n, width),
            following=after if spec else None,
            num_prompts=len(prompts),
            st=st,
            q_slots=q_slots,
            penalties=penalties,
            top_logprobs=logprobs_top(requests),
            request_ids=[r.request_id for r in reqs],
            bitmask=mask,
        )

    def masks(self, requests: list[LlmRequest], width: int) -> torch.Tensor | None:
        """The grammars' mask rows of a step's rows (``requests`` in row order) on the device;
        None when none has a grammar."""
        mask = self.guided.fill(requests, width) if self.guided is not None else None
        if mask is None:
            return None
        return self._staging[2].upload(torch.empty_like(mask, device=self.device), mask)


@dataclass
class BucketInputs:
    """A graph bucket's inputs: ``ints`` holds the token ids ``[B * T]``, each sequence's first
    position ``[B]`` and the rows' int columns; ``floats`` the float columns. ``step`` views them."""

    layout: RowLayout
    ints: torch.Tensor
    floats: torch.Tensor | None
    step: StepInputs
    staging: tuple[PinnedStaging, PinnedStaging, PinnedStaging]  # ints, floats, masks
    # [B * T, W] int32 the rows' grammar masks (an extras bucket's; ``step.bitmask`` is it)
    bitmask: torch.Tensor | None = None
    masked: bool = False  # the last write left a grammar's mask in it (else all ones)


def bucket_tensors(
    sizes: Sequence[int], n: int, layout: RowLayout, top_k: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], tuple]:
    """A bucket's zeroed storage: ``ints`` holding int columns of ``sizes``, then ``n`` rows' int
    values; ``floats`` their float values. Returns both, the columns, and the rows' views
    (``row_views``)."""
    ints = torch.zeros(sum(sizes) + n * layout.num_ints, dtype=torch.long, device=device)
    floats = None
    if layout.num_floats:
        floats = torch.zeros(n * layout.num_floats, dtype=torch.float32, device=device)
    *columns, row_ints = ints.split([*sizes, n * layout.num_ints])
    return ints, floats, columns, row_views(row_ints, floats, n, layout, top_k=top_k)


def bucket_inputs(
    batch_size: int,
    max_draft_len: int,
    layout: RowLayout,
    top_k: bool,
    extras: bool,
    device: torch.device,
    mask_words: int = 0,
) -> BucketInputs:
    """A bucket's inputs for ``batch_size`` rows (``extras``: logprobs of ``MAX_LOGPROBS`` top
    tokens, and with ``mask_words`` a grammar mask row of that many words per logits row),
    zeroed (the masks all ones)."""
    width = max_draft_len + 1
    sizes = [batch_size * width, batch_size]
    ints, floats, (input_ids, first_positions), rows = bucket_tensors(
        sizes, batch_size, layout, top_k, device
    )
    st, q_slots, penalties = rows
    step = StepInputs(
        input_ids=input_ids,
        drafts=input_ids.view(batch_size, width)[:, 1:],
        num_drafts=torch.full((batch_size,), max_draft_len, dtype=torch.long, device=device),
        rows=list(range(batch_size)),
        first_positions=first_positions,
        st=st,
        q_slots=q_slots,
        penalties=penalties,
        top_logprobs=MAX_LOGPROBS if extras else None,
    )
    bitmask = None
    if extras and mask_words:
        shape = (batch_size * width, mask_words)
        step.bitmask = bitmask = torch.full(shape, -1, dtype=torch.int32, device=device)
    staging = (PinnedStaging(), PinnedStaging(), PinnedStaging())
    return BucketInputs(layout, ints, floats, step, staging, bitmask)


def write_bucket(
    bucket: BucketInputs,
    requests: Sequence[LlmRequest],
    logits_state: LogitsState | None,
    draft_probs: DraftProbStore | None,
) -> None:
    """The requests' tokens, first positions and row values into the bucket (its last rows
    padding: token 0 at position 0, greedy, the scratch slots), one copy per dtype."""
    batch_size = bucket.step.num_rows
    pad = batch_size - len(requests)
    tokens = [t for r in requests for t in (r.last_token, *r.py_draft_tokens)]
    tokens += [0] * (pad * bucket.step.width)
    tokens += [r.get_num_tokens() - 1 for r in requests] + [0] * pad
    ints, floats = row_values(requests, pad, bucket.layout, logits_state, draft_probs)
    bucket.staging[0].upload(bucket.ints, torch.tensor(tokens + ints, dtype=torch.long))
    if bucket.floats is not None:
        bucket.staging[1].upload(bucket.floats, torch.tensor(floats, dtype=torch.float32))


def write_masks(bucket: BucketInputs, mask: torch.Tensor | None) -> None:
    """The rows' grammar masks into an extras bucket: ``mask`` for its first rows
    (``GuidedDecoder.fill``; None: no grammar), all ones for the rest (one copy, none when the
    bucket already holds all ones)."""
    if mask is None and not bucket.masked:
        return
    host = torch.full(bucket.bitmask.shape, -1, dtype=torch.int32)
    if mask is not None:
        host[: mask.shape[0]] = mask
    bucket.staging[2].upload(bucket.bitmask, host)
    bucket.masked = mask is not None
