"""TrtllmAttentionMetadata: one step's batch, as every attention op of the model sees it.

Built once per step by the model engine. Sequences are ordered contexts first, then generations.
The step's tokens are flattened: sequence ``i`` owns tokens ``[cu_seqlens[i], cu_seqlens[i+1])``
at positions ``[num_cached_tokens[i], kv_lens[i])``::

    tokens   | seq 0 (context chunk) ........ | seq 1 (ctx) ... | seq 2 (gen) | seq 3 (gen: last + drafts) |
    position   c0 .. c0+len0-1                  c1 ..             c2            c3 .. c3+k

The block table (``kv_cache_block_offsets``) and the page size come from ``kv_cache_manager``;
``swap_kv_cache_manager`` replaces both for the span of a ``with`` block (the Eagle3 draft loop reads
its KV through another manager or a sub-page view) and restores them afterwards, even on error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tensorrt_llm._torch.attention_backend.interface import PagedKVCache


@dataclass
class TrtllmAttentionMetadata:
    kv_cache_manager: PagedKVCache
    request_ids: list[int]
    seq_lens: list[int]  # query tokens per sequence this step
    num_cached_tokens_per_seq: list[int]  # KV positions each sequence already had
    num_contexts: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    # Filled by prepare():
    kv_cache_block_offsets: torch.Tensor = field(init=False)  # [num_pools, num_seqs, 2, max_blocks]
    seq_lens_cpu: torch.Tensor = field(init=False)  # [num_seqs]
    kv_lens_cpu: torch.Tensor = field(init=False)  # [num_seqs]
    cu_seqlens: list[int] = field(init=False)  # [num_seqs + 1]
    position_ids_cpu: torch.Tensor = field(init=False)  # [num_tokens]
    position_ids: torch.Tensor = field(init=False)  # [num_tokens], on device
    # [num_tokens], on device: the sequence each token belongs to
    token_seq_idx: torch.Tensor = field(init=False)
    # On device, int32, for kernels: [num_seqs + 1] query-token offsets, [num_seqs] KV lengths
    # after the step, [num_seqs] positions already cached (the first query token's position).
    cu_seqlens_q: torch.Tensor = field(init=False)
    kv_lens: torch.Tensor = field(init=False)
    num_cached_tokens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if not (len(self.seq_lens) == len(self.num_cached_tokens_per_seq) == n):
            raise ValueError(
                "request_ids, seq_lens and num_cached_tokens_per_seq must have one entry per sequence"
            )
        if not 0 <= self.num_contexts <= n:
            raise ValueError(f"num_contexts={self.num_contexts} out of range for {n} sequences")
        self.prepare()

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_generations(self) -> int:
        return self.num_seqs - self.num_contexts

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def tokens_per_block(self) -> int:
        return self.kv_cache_manager.tokens_per_block

    def prepare(self) -> None:
        """Derive the per-token tensors and fetch the block table from the attached manager."""
        self.seq_lens_cpu = torch.tensor(self.seq_lens, dtype=torch.long)
        cached = torch.tensor(self.num_cached_tokens_per_seq, dtype=torch.long)
        self.kv_lens_cpu = cached + self.seq_lens_cpu
        self.cu_seqlens = [0]
        for length in self.seq_lens:
            self.cu_seqlens.append(self.cu_seqlens[-1] + length)
        seq_idx_cpu = torch.repeat_interleave(torch.arange(self.num_seqs), self.seq_lens_cpu)
        starts = torch.tensor(self.cu_seqlens[:-1], dtype=torch.long)
        offset_in_seq = torch.arange(self.num_tokens) - starts[seq_idx_cpu]
        self.position_ids_cpu = cached[seq_idx_cpu] + offset_in_seq
        self.position_ids = self.position_ids_cpu.to(self.device)
        self.token_seq_idx = seq_idx_cpu.to(self.device)
        self.cu_seqlens_q = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=self.device)
        self.kv_lens = self.kv_lens_cpu.to(device=self.device, dtype=torch.int32)
        self.num_cached_tokens = cached.to(device=self.device, dtype=torch.int32)
        self._fetch_block_offsets()

    def _fetch_block_offsets(self) -> None:
        manager = self.kv_cache_manager
        num_pools = manager.num_pools
        self.kv_cache_block_offsets = torch.zeros(
            num_pools,
            max(self.num_seqs, 1),
            2,
            manager.max_blocks_per_seq,
            dtype=torch.int32,
            device=self.device,
        )
        if self.num_seqs:
            manager.copy_batch_block_offsets(
                self.kv_cache_block_offsets, self.request_ids, 1, self.num_contexts, self.num_seqs
            )

    @contextlib.contextmanager
    def swap_kv_cache_manager(self, manager: PagedKVCache | None) -> Iterator[None]:
        """Attend through ``manager`` (and its block table) inside the block; ``None`` keeps the current."""
        if manager is None or manager is self.kv_cache_manager:
            yield
            return
        saved = (self.kv_cache_manager, self.kv_cache_block_offsets)
        self.kv_cache_manager = manager
        try:
            self._fetch_block_offsets()
            yield
        finally:
            self.kv_cache_manager, self.kv_cache_block_offsets = saved

    def seq_token_slice(self, i: int) -> slice:
        return slice(self.cu_seqlens[i], self.cu_seqlens[i + 1])

    def split_by_seq(self, tokens: torch.Tensor) -> Sequence[torch.Tensor]:
        return torch.split(tokens, self.seq_lens)
