"""A mixed graph bucket's inputs: prompts that finish in the step beside up to ``B`` decoding
requests (or alone), replayed from a CUDA graph like a decode-only bucket (``cuda_graph_runner``).

The graph's launches are sized by the bucket's shape (``GraphShape``: ``P`` prompt rows whose
chunks share ``C`` tokens, ``B`` decode rows), never by the step's own lengths, so the prompts'
lengths and cached prefixes are inputs written before each replay::

    sequences (S = P + B + 1) | prompt 0 | ... | prompt P-1 | decode 0 | ... | decode B-1 | padding |
    tokens    (N = C + B T)   |   L_0    | ... |  L_{P-1}   |    T     | ... |     T      |  C - U  |

Each prompt's chunk (the tokens it has not cached) is ``L_i`` tokens; a prompt row the step does not
fill (``p < P`` prompts) and each decode row it does not fill are padding rows of one and of ``T``
tokens on the padding sequence; ``U`` is what the prompt rows use, and the padding sequence takes
the rest, so its K and V go where nothing reads them. Because the decode rows' tokens start after
the prompts', the query offsets (each token's sequence is derived from them on the device) and each
row's logits tokens are written per step with the rest (one copy per dtype). Rows ``n = P + B``: the
prompts', then the decode rows', as in every step (``step_inputs``); the draft chain runs on the
``n`` first sequences, whose block-table rows are the step's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.step_inputs import (
    BucketInputs,
    RowLayout,
    StepInputs,
    bucket_tensors,
    row_values,
)
from tensorrt_llm.runtime.staging import PinnedStaging
from tensorrt_llm.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
    from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore


@dataclass(frozen=True)
class GraphShape:
    """A CUDA graph bucket's shape: ``batch_size`` decoding rows and, in a mixed bucket,
    ``num_prompts`` prompt rows whose chunks share ``prompt_tokens`` tokens (0: a decode-only
    bucket)."""

    batch_size: int
    prompt_tokens: int = 0
    num_prompts: int = 0

    def __post_init__(self) -> None:
        if (self.prompt_tokens > 0) != (self.num_prompts > 0):
            raise ValueError(f"{self}: prompt rows need prompt tokens, and the other way round")

    @property
    def num_rows(self) -> int:
        return self.num_prompts + self.batch_size

    def num_tokens(self, tokens_per_seq: int) -> int:
        """The tokens the bucket's forward carries (padded)."""
        return self.prompt_tokens + self.batch_size * tokens_per_seq


def prompt_tokens_used(prompts: Sequence[LlmRequest], num_prompts: int) -> int:
    """The prompt tokens of a bucket of ``num_prompts`` prompt rows that ``prompts`` fill (one
    per padding row)."""
    return sum(len(p.context_chunk) for p in prompts) + num_prompts - len(prompts)


def mixed_seq_lens(shape: GraphShape, width: int) -> list[int]:
    """The query lengths the bucket's metadata is built with: the bounds its launches are sized
    by (a prompt may take all ``C`` tokens, a decode row has ``T``)."""
    prompts = [shape.prompt_tokens] + [0] * (shape.num_prompts - 1)
    return prompts + [width] * shape.batch_size + [0]


def _sizes(shape: GraphShape, max_draft_len: int) -> list[int]:
    """The int columns of a mixed bucket before its rows' values, in order: token ids, first
    positions, query offsets, rows' logits tokens, drafts, draft counts, following tokens."""
    width, n = max_draft_len + 1, shape.num_rows
    seqs, tokens = n + 1, shape.num_tokens(width)
    following = tokens if max_draft_len else 0
    return [tokens, seqs, seqs + 1, n * width, n * max_draft_len, n, following]


def mixed_bucket_inputs(
    shape: GraphShape,
    max_draft_len: int,
    layout: RowLayout,
    top_k: bool,
    extras: bool,
    device: torch.device,
) -> BucketInputs:
    """A mixed bucket's inputs (``extras``: logprobs of ``MAX_LOGPROBS`` top tokens), zeroed."""
    width, n = max_draft_len + 1, shape.num_rows
    ints, floats, columns, rows = bucket_tensors(
        _sizes(shape, max_draft_len), n, layout, top_k, device
    )
    ids, first, cu, index, drafts, counts, following = columns
    st, q_slots, penalties = rows
    step = StepInputs(
        input_ids=ids,
        drafts=drafts.view(n, max_draft_len),
        num_drafts=counts,
        rows=list(range(n)),
        token_index=index.view(n, width),
        first_positions=first,
        cu_seqlens_q=cu,
        following=following if max_draft_len else None,
        num_prompts=shape.num_prompts,
        st=st,
        q_slots=q_slots,
        penalties=penalties,
        top_logprobs=MAX_LOGPROBS if extras else None,
    )
    staging = (PinnedStaging(), PinnedStaging(), PinnedStaging())
    return BucketInputs(layout, ints, floats, step, staging)


def write_mixed_bucket(
    bucket: BucketInputs,
    shape: GraphShape,
    prompts: Sequence[LlmRequest],
    requests: Sequence[LlmRequest],
    logits_state: LogitsState | None,
    draft_probs: DraftProbStore | None,
) -> int:
    """The prompts' chunks and the decoding ``requests``' rows into the bucket, the rows they do
    not fill padding (at position 0, greedy, the scratch slots), one copy per dtype. Returns
    where the decode rows' tokens start."""
    k = bucket.step.drafts.shape[1]
    width = k + 1
    pad_prompts, pad_rows = shape.num_prompts - len(prompts), shape.batch_size - len(requests)
    chunks = [p.context_chunk for p in prompts] + [[0]] * pad_prompts
    used = sum(map(len, chunks))
    seq_lens = [len(c) for c in chunks] + [width] * shape.batch_size + [shape.prompt_tokens - used]
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    tokens = [t for c in chunks for t in c]
    tokens += [t for r in requests for t in (r.last_token, *r.py_draft_tokens)]
    tokens += [0] * (pad_rows * width + shape.prompt_tokens - used)
    first = [p.context_current_position for p in prompts] + [0] * pad_prompts
    first += [r.get_num_tokens() - 1 for r in requests] + [0] * (pad_rows + 1)
    index = [cu[i + 1] - 1 for i in range(shape.num_prompts) for _ in range(width)]
    index += [used + i * width + j for i in range(shape.batch_size) for j in range(width)]
    drafts = [0] * (shape.num_prompts * k) + [d for r in requests for d in r.py_draft_tokens]
    drafts += [0] * (pad_rows * k)
    counts = [0] * shape.num_prompts + [k] * shape.batch_size
    following: list[int] = []
    if k:  # a prompt token is followed by the next prompt token; the others are the step's
        for p, chunk in zip(prompts, chunks, strict=False):
            start = p.context_current_position + 1
            after = p.prompt_token_ids[start : start + len(chunk)]
            following += after + [0] * (len(chunk) - len(after))
        following += [0] * (len(tokens) - len(following))
    ints, floats = _row_columns(
        [(prompts, pad_prompts), (requests, pad_rows)], bucket.layout, logits_state, draft_probs
    )
    host = first + cu + index + drafts + counts + following + ints
    bucket.staging[0].upload(bucket.ints, torch.tensor(tokens + host, dtype=torch.long))
    if bucket.floats is not None:
        bucket.staging[1].upload(bucket.floats, torch.tensor(floats, dtype=torch.float32))
    return used


def _row_columns(
    groups: list[tuple[Sequence[LlmRequest], int]],
    layout: RowLayout,
    logits_state: LogitsState | None,
    draft_probs: DraftProbStore | None,
) -> tuple[list[int], list[float]]:
    """``row_values`` of rows in groups, each group's requests then its padding rows: a column
    per value, each column the groups' in order."""
    parts = [
        (row_values(reqs, pad, layout, logits_state, draft_probs), len(reqs) + pad)
        for reqs, pad in groups
    ]
    out: tuple[list[int], list[float]] = ([], [])
    for kind, columns in enumerate((layout.num_ints, layout.num_floats)):
        for c in range(columns):
            for values, n in parts:
                out[kind].extend(values[kind][c * n : (c + 1) * n])
    return out
