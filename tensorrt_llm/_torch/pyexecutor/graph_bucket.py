"""A CUDA graph bucket's static tensors (``cuda_graph_runner``): its inputs, metadata and outputs,
and the addresses a captured graph reads."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.pyexecutor.step_inputs import BucketInputs
from tensorrt_llm._torch.pyexecutor.step_program import StepOutputs

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


@dataclass
class Bucket:
    """A batch size's static inputs (``step_inputs.bucket_inputs``: the step's ``StepInputs``
    are views of them) and two metadata objects whose buffers never move (``rebind`` per step):
    the step's and the draft chain's."""

    inputs: BucketInputs
    md: AttentionMetadata
    chain_md: AttentionMetadata | None
    _: KW_ONLY  # the rest by name: a field added here cannot take another's place
    graph: torch.cuda.CUDAGraph | None = None
    outputs: StepOutputs | None = None  # what the graph wrote at its last replay
    addresses: dict[str, int] = field(default_factory=dict)  # what the graph reads, at capture


def addresses(
    bucket: Bucket, store: DraftProbStore | None, logits_state: LogitsState | None
) -> dict[str, int]:
    """Where the tensors a graph reads live (they must not move between capture and replay)."""
    inputs = bucket.inputs
    out = {"ints": inputs.ints.data_ptr()}
    if inputs.floats is not None:
        out["floats"] = inputs.floats.data_ptr()
    if inputs.layout.penalties:
        out.update(counts=logits_state.counts.data_ptr(), bias=logits_state.bias.data_ptr())
    if inputs.layout.q_slots:
        out.update(q=store.table.data_ptr(), has_q=store.has_q.data_ptr())
    for tag, metadata in (("step", bucket.md), ("chain", bucket.chain_md)):
        if metadata is not None:
            out.update({f"{tag}/{k}": v for k, v in metadata.tensor_addresses().items()})
    return out
