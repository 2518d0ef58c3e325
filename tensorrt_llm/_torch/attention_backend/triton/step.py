"""``StepBatch``: the step's sequences as the attention kernel reads them (device int32 tensors plus
the two host maxima that size the launch, so launching needs no device-to-host sync)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata


@dataclass(frozen=True)
class StepBatch:
    """Sequence ``s`` owns query tokens ``[cu_seqlens_q[s], cu_seqlens_q[s + 1])`` at KV positions
    ``[num_cached_tokens[s], kv_lens[s])``: a context chunk (causal over its own tokens, after any
    cached prefix) or a generation step of ``1 + max_draft_len`` tokens alike."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, on the device
    kv_lens: torch.Tensor  # [num_seqs] int32: KV positions after the step
    num_cached_tokens: torch.Tensor  # [num_seqs] int32: the first query token's position
    max_query_len: int  # host: max over sequences of the query tokens
    max_kv_len: int  # host: max over sequences of kv_lens

    def __post_init__(self) -> None:
        num_seqs = self.kv_lens.shape[0]
        shapes = (self.cu_seqlens_q.shape, self.kv_lens.shape, self.num_cached_tokens.shape)
        if shapes != ((num_seqs + 1,), (num_seqs,), (num_seqs,)):
            raise ValueError(
                "cu_seqlens_q, kv_lens, num_cached_tokens have shapes "
                f"{[tuple(s) for s in shapes]}; expected [num_seqs + 1], [num_seqs], [num_seqs]"
            )
        for name in ("cu_seqlens_q", "kv_lens", "num_cached_tokens"):
            if getattr(self, name).dtype != torch.int32:
                raise ValueError(f"StepBatch.{name} is {getattr(self, name).dtype}; expected int32")

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]

    @classmethod
    def from_metadata(cls, metadata: AttentionMetadata) -> StepBatch:
        return cls(
            metadata.cu_seqlens_q,
            metadata.kv_lens,
            metadata.num_cached_tokens,
            max(metadata.seq_lens, default=0),
            metadata.max_kv_len,
        )
