"""A CUDA graph bucket's static tensors (``cuda_graph_runner``): its inputs, metadata and outputs,
and the addresses a captured graph reads."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens
from tensorrt_llm._torch.pyexecutor.sampler import SamplingTensors
from tensorrt_llm.runtime.staging import PinnedStaging

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
    from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore


@dataclass
class Bucket:
    """A batch size's static inputs. ``inputs`` holds the token ids ``[B * T]``, each sequence's
    first position ``[B]``, and in a sampled bucket each row's top-k, seed and counter ``[3, B]``
    (with Eagle3, then its ``DraftProbStore`` slot ``[B]``),
    copied in one transfer through pinned staging (the temperatures and top-p ``[2, B]`` in a
    second, ``float_inputs``); ``md`` and ``chain_md`` keep their buffers for the bucket's life
    (``rebind`` per step)."""

    batch_size: int
    inputs: torch.Tensor  # on the device
    md: AttentionMetadata
    chain_md: AttentionMetadata | None
    _: KW_ONLY  # the rest by name: a field added here cannot take another's place
    float_inputs: torch.Tensor | None = None  # a sampled bucket's
    uses_top_k: bool = False  # a sampled bucket's draws sort (``sampler.sample``)
    top_logprobs: int | None = None  # the logprobs the graph computes (their top count), if any
    # a bucket with penalties or bias: each row's LogitsState slot [B], and presence and
    # frequency [2, B]
    penalty_slots: torch.Tensor | None = None
    penalties: torch.Tensor | None = None
    # the host side of each copy (on CUDA pinned, reused once the last copy from it is done)
    staging: tuple[PinnedStaging, ...] = ()
    graph: torch.cuda.CUDAGraph | None = None
    # logits [B * T, V], target argmax [B, T], and with Eagle3 num_accepted [B], drafts [B, K]
    outputs: tuple[torch.Tensor, ...] = ()
    addresses: dict[str, int] = field(default_factory=dict)  # what the graph reads, at capture

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inputs[: self.md.num_tokens]

    @property
    def first_positions(self) -> torch.Tensor:
        return self.inputs[self.md.num_tokens : self.md.num_tokens + self.batch_size]

    @property
    def sampled(self) -> bool:
        return self.float_inputs is not None

    def sampling(self) -> SamplingTensors:
        start = self.md.num_tokens + self.batch_size
        top_k, seed, counter = self.inputs[start : start + 3 * self.batch_size].view(3, -1)
        temperature, top_p = self.float_inputs.view(2, -1)
        return SamplingTensors(
            temperature, top_k, top_p, seed, counter, False, uses_top_k=self.uses_top_k
        )

    @property
    def slots(self) -> torch.Tensor:
        """(a sampled Eagle3 bucket) each row's ``DraftProbStore`` slot"""
        return self.inputs[self.md.num_tokens + 4 * self.batch_size :]


@dataclass
class GraphStep:
    """What a replayed step gives the executor: its logits rows and its tokens."""

    logits: torch.Tensor  # [num_requests * tokens_per_seq, vocab]
    num_logits: list[int]
    tokens: DeviceTokens


def addresses(
    bucket: Bucket, store: DraftProbStore | None, logits_state: LogitsState | None
) -> dict[str, int]:
    """Where the tensors a graph reads live (they must not move between capture and replay)."""
    out = {"inputs": bucket.inputs.data_ptr()}
    if bucket.penalties is not None:
        out.update(penalty_slots=bucket.penalty_slots.data_ptr())
        out.update(penalties=bucket.penalties.data_ptr())
        out.update(counts=logits_state.counts.data_ptr(), bias=logits_state.bias.data_ptr())
    if bucket.sampled:
        out["float_inputs"] = bucket.float_inputs.data_ptr()
        if store is not None:
            out.update(q=store.table.data_ptr(), has_q=store.has_q.data_ptr())
    for tag, metadata in (("step", bucket.md), ("chain", bucket.chain_md)):
        if metadata is not None:
            out.update({f"{tag}/{k}": v for k, v in metadata.tensor_addresses().items()})
    return out
