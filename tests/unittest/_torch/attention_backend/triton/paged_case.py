"""Random paged-KV cases for the Triton kernel tests.

A case holds each sequence's dense K and V (the oracle's input), the same values scattered over
shuffled pages of a strided pool view ``[num_pages, 2, page_tokens, Hkv, D]`` (as a manager's
``get_kv_pages`` gives), and a step's tokens. Every page row no sequence owns is NaN, so a kernel
that reads past a sequence's length, or misses a write, shows up as NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm._torch.attention_backend.reference import causal_attention
from tensorrt_llm._torch.attention_backend.triton.addressing import PageAddressing, PagedKV
from tensorrt_llm._torch.attention_backend.triton.step import StepBatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Batch 17, contexts first: a 1-token prompt, a 97-token prompt, a chunk of 30 after 50 cached
# (chunked prefill), 13 new tokens after a reused 128-token prefix, a 33-token prompt; then 12
# generation steps of 1 + 3 draft tokens at cached lengths around page boundaries.
MIXED_Q = [1, 97, 30, 13, 33] + [4] * 12
MIXED_CACHED = [0, 0, 50, 128, 0] + [5, 1, 28, 31, 60, 63, 64, 95, 127, 128, 129, 190]


@dataclass
class PagedCase:
    kv: PagedKV
    batch: StepBatch
    keys: list[torch.Tensor]  # per sequence [kv_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], a strided view
    cached: list[int]
    q_lens: list[int]
    position_ids: torch.Tensor  # [num_tokens] int64
    token_seq_idx: torch.Tensor  # [num_tokens] int64

    def step_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's K and V, ``[num_tokens, num_kv_heads, head_dim]`` each."""
        spans = list(zip(self.cached, self.q_lens))
        k = torch.cat([keys[c : c + n] for keys, (c, n) in zip(self.keys, spans)])
        v = torch.cat([values[c : c + n] for values, (c, n) in zip(self.values, spans)])
        return k, v

    def reference(self, scale: float) -> torch.Tensor:
        """``causal_attention`` per sequence on the dense K/V: ``[num_tokens, heads, head_dim]``."""
        outs, start = [], 0
        for keys, values, c, n in zip(self.keys, self.values, self.cached, self.q_lens):
            pos = torch.arange(c, c + n, device=self.q.device)
            outs.append(causal_attention(self.q[start : start + n], keys, values, pos, scale))
            start += n
        return torch.cat(outs)


def make_case(
    q_lens: list[int],
    cached: list[int],
    page_tokens: int,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    """Sequences of ``cached[s]`` positions already in the pages plus ``q_lens[s]`` step tokens
    (not yet in the pages: the test writes them)."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = [c + n for c, n in zip(cached, q_lens)]
    blocks = [-(-length // page_tokens) for length in kv_lens]
    num_pages = 2 * sum(blocks) + 3  # + spare pages nobody owns
    order = torch.randperm(num_pages, generator=g).int()
    table = torch.full((len(kv_lens), 2, max(blocks) + 2), int(order[-1]), dtype=torch.int32)
    pool = torch.full((num_pages, 2, page_tokens, num_kv_heads, head_dim), float("nan"))
    keys, values, used = [], [], 0
    for s, (length, nb) in enumerate(zip(kv_lens, blocks)):
        for lane in (0, 1):
            table[s, lane, :nb] = order[used : used + nb]
            used += nb
        keys.append(torch.randn(length, num_kv_heads, head_dim, generator=g).to(dtype))
        values.append(torch.randn(length, num_kv_heads, head_dim, generator=g).to(dtype))
        pos = torch.arange(cached[s])  # the cached prefix, stored by hand: K at lane 0, V at 1
        for lane, src in ((0, keys[s]), (1, values[s])):
            pages = table[s, lane, pos // page_tokens].long()
            pool[pages, lane, pos % page_tokens] = src[: cached[s]].float()
    pool = pool.to(dtype).to(DEVICE)
    num_tokens, num_heads = sum(q_lens), num_kv_heads * group
    q_wide = torch.randn(num_tokens, num_heads, head_dim + 3, generator=g).to(dtype)
    seq_idx = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, q_lens)])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    batch = StepBatch(
        cu.to(DEVICE),
        torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(cached, dtype=torch.int32, device=DEVICE),
        max(q_lens),
        max(kv_lens),
    )
    kv = PagedKV(pool[:, 0], pool[:, 1], table.to(DEVICE), PageAddressing.plain(page_tokens))
    return PagedCase(
        kv,
        batch,
        [t.to(DEVICE) for t in keys],
        [t.to(DEVICE) for t in values],
        q_wide.to(DEVICE)[..., :head_dim],
        list(cached),
        list(q_lens),
        positions.to(DEVICE),
        seq_idx.to(DEVICE),
    )
