"""A CUDA graph bucket's static tensors (``cuda_graph_runner``): its inputs, metadata and outputs,
and the addresses a captured graph reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.pyexecutor.mixed_bucket import (
    GraphShape,
    mixed_bucket_inputs,
    mixed_seq_lens,
)
from tensorrt_llm._torch.pyexecutor.step_inputs import BucketInputs, RowLayout, bucket_inputs
from tensorrt_llm._torch.pyexecutor.step_program import Forwarded, StepOutputs

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
    from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore


@dataclass
class Bucket:
    """A batch size's static inputs (``step_inputs.bucket_inputs``: the step's ``StepInputs``
    are views of them) and two metadata objects whose buffers never move (``rebind`` per step):
    the step's and the draft chain's."""

    inputs: BucketInputs
    md: AttentionMetadata
    chain_md: AttentionMetadata | None
    _: KW_ONLY  # the rest by name: a field added here cannot take another's place
    graph: torch.cuda.CUDAGraph | None = None  # the step's first part (``forward_step``)
    finish_graph: torch.cuda.CUDAGraph | None = None  # its second (``finish_step``)
    forwarded: Forwarded | None = None  # what the first part left (run without graphs)
    outputs: StepOutputs | None = None  # what the graph wrote at its last replay
    addresses: dict[str, int] = field(default_factory=dict)  # what the graph reads, at capture


def new_bucket(
    shape: GraphShape,
    layout: RowLayout,
    top_k: bool,
    extras: bool,
    max_draft_len: int,
    device: torch.device,
    metadata: Callable[[list[int], int], AttentionMetadata],
    draft_chain: bool,
    mask_words: int = 0,
) -> Bucket:
    """A bucket of ``shape`` whose rows carry ``layout``'s values (zeroed); ``metadata(seq_lens,
    num_contexts)`` makes a metadata of the padding sequence with the step's bounds (and, with
    ``draft_chain``, of one token for each row's sequence: the draft chain's)."""
    width = max_draft_len + 1
    if shape.num_prompts:
        inputs = mixed_bucket_inputs(shape, max_draft_len, layout, top_k, extras, device)
        seq_lens = mixed_seq_lens(shape, width)
    else:
        inputs = bucket_inputs(
            shape.batch_size, max_draft_len, layout, top_k, extras, device, mask_words
        )
        seq_lens = [width] * shape.batch_size
    chain_md = metadata([1] * shape.num_rows, 0) if draft_chain else None
    return Bucket(inputs, metadata(seq_lens, shape.num_prompts), chain_md)


def addresses(
    bucket: Bucket, store: DraftProbStore | None, logits_state: LogitsState | None
) -> dict[str, int]:
    """Where the tensors a graph reads live (they must not move between capture and replay)."""
    inputs = bucket.inputs
    out = {"ints": inputs.ints.data_ptr()}
    if inputs.floats is not None:
        out["floats"] = inputs.floats.data_ptr()
    if inputs.bitmask is not None:
        out["bitmask"] = inputs.bitmask.data_ptr()
    if inputs.layout.penalties:
        out.update(counts=logits_state.counts.data_ptr(), bias=logits_state.bias.data_ptr())
        words = logits_state.bad_words
        out.update(words=words.words.data_ptr(), recent=words.recent.data_ptr())
    if inputs.layout.q_slots:
        out.update(q=store.table.data_ptr(), has_q=store.has_q.data_ptr())
        if store.phases is not None:
            out["phases"] = store.phases.phase.data_ptr()
    for tag, metadata in (("step", bucket.md), ("chain", bucket.chain_md)):
        if metadata is not None:
            out.update({f"{tag}/{k}": v for k, v in metadata.tensor_addresses().items()})
    return out
