"""A mixed graph bucket's inputs: one prompt that finishes in the step beside up to ``B`` decoding
requests, replayed from a CUDA graph like a decode-only bucket (``cuda_graph_runner.py``).

The graph's launches are sized by the bucket's shape (``GraphShape``: ``B`` decode rows, a prompt
of up to ``C`` tokens), never by the step's own lengths, so the prompt's length and its cached
prefix are inputs written before each replay::

    sequences (S = B + 2)  | prompt | decode row 0 | ... | decode row B-1 | padding |
    tokens    (N = C + BT) |   L    |      T       | ... |       T        |  C - L  |

``L <= C`` is the prompt's chunk (the tokens it has not cached), the decode rows (padded ones on
the padding sequence) have ``T = 1 + K`` tokens each, and the padding sequence takes the ``C - L``
tokens the prompt leaves, so its K and V go where nothing reads them. Because the decode rows'
tokens start after the prompt's, the query offsets, each token's sequence and each row's logits
tokens are written per step with the rest (one copy per dtype). Rows ``n = B + 1``: the prompt's,
then the decode rows', as in every step (``step_inputs``); the draft chain runs on the ``n``
first sequences, whose block-table rows are the step's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.pyexecutor.graph_bucket import GraphShape
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.step_inputs import (
    BucketInputs,
    RowLayout,
    StepInputs,
    row_values,
    row_views,
)
from tensorrt_llm.runtime.staging import PinnedStaging
from tensorrt_llm.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
    from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore


def mixed_seq_lens(shape: GraphShape, width: int) -> list[int]:
    """The query lengths the bucket's metadata is built with: the bounds its launches are sized
    by (the prompt's ``C``, each row's ``T``; the padding sequence's share is the prompt's)."""
    return [shape.prompt_tokens] + [width] * shape.batch_size + [0]


def _sizes(shape: GraphShape, max_draft_len: int, layout: RowLayout) -> list[int]:
    """The int columns of a mixed bucket, in order: token ids, first positions, query offsets,
    token sequences, rows' logits tokens, drafts, draft counts, following tokens, row values."""
    width, n = max_draft_len + 1, shape.num_rows
    seqs, tokens = shape.batch_size + 2, shape.num_tokens(width)
    following = tokens if max_draft_len else 0
    return [tokens, seqs, seqs + 1, tokens, n * width, n * max_draft_len, n, following,
            n * layout.num_ints]  # fmt: skip


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
    sizes = _sizes(shape, max_draft_len, layout)
    ints = torch.zeros(sum(sizes), dtype=torch.long, device=device)
    floats = None
    if layout.num_floats:
        floats = torch.zeros(n * layout.num_floats, dtype=torch.float32, device=device)
    ids, first, cu, seq_idx, index, drafts, counts, following, row_ints = ints.split(sizes)
    st, q_slots, penalties = row_views(row_ints, floats, n, layout, top_k=top_k)
    step = StepInputs(
        input_ids=ids,
        drafts=drafts.view(n, max_draft_len),
        num_drafts=counts,
        rows=list(range(n)),
        token_index=index.view(n, width),
        first_positions=first,
        cu_seqlens_q=cu,
        token_seq_idx=seq_idx,
        following=following if max_draft_len else None,
        num_prompts=1,
        st=st,
        q_slots=q_slots,
        penalties=penalties,
        top_logprobs=MAX_LOGPROBS if extras else None,
    )
    return BucketInputs(layout, ints, floats, step, (PinnedStaging(), PinnedStaging()))


def prompt_chunk(prompt: LlmRequest) -> list[int]:
    """The prompt tokens a step computes (its chunk: the ones not cached)."""
    start = prompt.context_current_position
    return prompt.prompt_token_ids[start : start + prompt.context_chunk_size]


def write_mixed_bucket(
    bucket: BucketInputs,
    shape: GraphShape,
    prompt: LlmRequest | None,
    requests: Sequence[LlmRequest],
    logits_state: LogitsState | None,
    draft_probs: DraftProbStore | None,
) -> int:
    """The prompt's chunk and the decoding ``requests``' rows into the bucket (the rest padding:
    token 0 at position 0, greedy, the scratch slots; ``prompt`` None: a padding prompt of no
    tokens, at capture, with no ``requests``), one copy per dtype. Returns where the decode
    rows' tokens start (the chunk's length)."""
    if prompt is None and requests:
        raise ValueError("a mixed bucket's rows start with its prompt's")
    k = bucket.step.drafts.shape[1]
    width, pad = k + 1, shape.batch_size - len(requests)
    chunk = prompt_chunk(prompt) if prompt is not None else []
    length, bound = len(chunk), shape.prompt_tokens
    start = prompt.context_current_position if prompt is not None else 0
    seq_lens = [length] + [width] * shape.batch_size + [bound - length]
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    tokens = chunk + [t for r in requests for t in (r.get_tokens()[-1], *r.py_draft_tokens)]
    tokens += [0] * (pad * width + bound - length)
    first = [start] + [r.get_num_tokens() - 1 for r in requests] + [0] * (pad + 1)
    seq_idx = [s for s, n in enumerate(seq_lens) for _ in range(n)]
    index = [max(length - 1, 0)] * width
    index += [length + i * width + j for i in range(shape.batch_size) for j in range(width)]
    drafts = [0] * k + [d for r in requests for d in r.py_draft_tokens] + [0] * (pad * k)
    counts = [0] + [k] * shape.batch_size
    following: list[int] = []
    if k:  # a prompt token is followed by the next prompt token; the others are the step's
        after = prompt.prompt_token_ids[start + 1 : start + 1 + length] if prompt else []
        following = after + [0] * (len(tokens) - len(after))
    rows = ([prompt] if prompt is not None else []) + list(requests)
    ints, floats = row_values(
        rows, pad + (prompt is None), bucket.layout, logits_state, draft_probs
    )
    host = first + cu + seq_idx + index + drafts + counts + following + ints
    bucket.staging[0].upload(bucket.ints, torch.tensor(tokens + host, dtype=torch.long))
    if bucket.floats is not None:
        bucket.staging[1].upload(bucket.floats, torch.tensor(floats, dtype=torch.float32))
    return length
