"""MiniMax sparse attention (MSA) of the published MiniMax-M3, in torch: the CPU path and the oracle.

On a sparse layer (``layer_types[i] == "minimax_m3_sparse"``) a lightning indexer picks, per query
token and per KV group, the key blocks the group's query heads attend. With ``B =
index_block_size``, index head ``g`` (one per KV group: ``index_n_heads == num_key_value_heads``),
a query at position ``p`` and the post-RoPE index-K of every cached key ``j``::

    token score  s[p, g, j] = q_idx[p, g] . k_idx[j]           raw fp32 dot product, j <= p
    block score  S[p, g, b] = max over j in block b (j <= p) of s[p, g, j]
    forced       blocks p//B - i, i < index_local_blocks (clamped at 0) score +inf
    selected     the top ``index_topk_blocks`` blocks by score, the forced ones counted among
                 them; blocks past p//B (score -inf) are never selected; equal scores go to the
                 earlier block
    attention    query head h of group g = h // (H / Hkv) attends the keys j <= p of the blocks
                 group g selected, with the usual softmax

Every query (each verify token of a speculative step too) selects its own blocks. While a
sequence has at most ``index_topk_blocks`` blocks, everything is selected and MSA equals dense
attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.reference import (
    causal_attention,
    gather_kv,
    gather_paged,
    write_kv,
    write_paged,
)


@dataclass(frozen=True)
class MsaConfig:
    """The indexer's selection rule (a MiniMax-M3 config's ``index_*`` keys)."""

    num_index_heads: int  # one per KV group (index_n_heads == num_key_value_heads)
    index_head_dim: int
    block_size: int  # index_block_size: keys per scored block
    topk_blocks: int  # index_topk_blocks: blocks each query keeps, the forced ones included
    local_blocks: int = 1  # index_local_blocks: blocks ending at the query's own, always kept

    def __post_init__(self) -> None:
        for name in ("num_index_heads", "index_head_dim", "block_size", "topk_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MsaConfig.{name}={value!r} must be a positive int")
        if not 0 <= self.local_blocks <= self.topk_blocks:
            raise ValueError(
                f"MsaConfig.local_blocks={self.local_blocks!r} must be in [0, topk_blocks="
                f"{self.topk_blocks}]"
            )


@dataclass(frozen=True)
class MsaInputs:
    """What the indexer computed for the step's tokens (``...`` is the token dims of ``q``).

    index_q: ``[..., G, index_head_dim]``, one index head per KV group this rank attends (normed,
    RoPE applied); index_k: ``[..., 1, index_head_dim]``, the one index-K head (normed, RoPE
    applied), cached per token like K.
    """

    index_q: torch.Tensor
    index_k: torch.Tensor


def index_block_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, q_pos: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``index_q [n, G, Di]``, ``index_k [L, Di]`` (key j at position j), query positions ``[n]``
    -> fp32 block scores ``[n, G, cdiv(L, block_size)]``: per block the max over its keys at a
    position ``<=`` the query's of the raw dot products; -inf where no key is visible."""
    length = index_k.shape[0]
    num_blocks = -(-length // block_size)
    scores = torch.einsum("ngd,ld->ngl", index_q.float(), index_k.float())  # [n, G, L]
    future = torch.arange(length, device=scores.device)[None, :] > q_pos[:, None].to(
        scores.device
    )  # [n, L]
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    pad = num_blocks * block_size - length
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return scores.unflatten(-1, (num_blocks, block_size)).amax(dim=-1)


def select_blocks(block_scores: torch.Tensor, q_pos: torch.Tensor, cfg: MsaConfig) -> torch.Tensor:
    """Block scores ``[n, G, num_blocks]`` and query positions ``[n]`` -> the selected blocks, bool
    ``[n, G, num_blocks]`` (the module docstring's rule)."""
    num_blocks = block_scores.shape[-1]
    blocks = torch.arange(num_blocks, device=block_scores.device)
    q_block = (q_pos.to(block_scores.device) // cfg.block_size)[:, None]  # [n, 1]
    # the forced blocks q_block - i, i < local_blocks, clamped at 0: [n, num_blocks]
    forced = (blocks[None, :] <= q_block) & (
        blocks[None, :] >= (q_block - cfg.local_blocks + 1).clamp(min=0)
    )
    scores = block_scores.masked_fill(forced[:, None, :], float("inf"))
    k = min(cfg.topk_blocks, num_blocks)
    top_scores, top_idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    return chosen.scatter_(-1, top_idx[..., :k], top_scores[..., :k] > float("-inf"))


def block_key_mask(selected: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Selected blocks ``[n, G, num_blocks]`` -> the keys they cover, bool ``[n, G, length]``."""
    return selected.repeat_interleave(block_size, dim=-1)[..., :length]


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    selected: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q [n, H, D]`` over ``k, v [L, Hkv, D]`` (key j at position j), each query
    head seeing the keys at positions ``<=`` its own in the blocks its KV group selected
    (``selected [n, Hkv, num_blocks]``). Returns ``[n, H, D]``."""
    mask = block_key_mask(selected, k.shape[0], block_size)
    return causal_attention(q, k, v, q_pos, scale, key_mask=mask)


def write_msa_step(
    layer_idx: int,
    k: torch.Tensor,
    v: torch.Tensor,
    index_k: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """Store the step's K, V ``[n, Hkv, D]`` and index-K ``[n, 1, Di]`` of a sparse layer at the
    step's positions, through the manager attached to ``metadata``."""
    write_kv(layer_idx, k, v, metadata)
    write_index_k(layer_idx, index_k, metadata)


def write_index_k(layer_idx: int, index_k: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Store the step's index-K ``[n, 1, Di]`` (addressed like K: lane 0 of the block table)."""
    manager = metadata.kv_cache_manager
    pool = manager.layer_pool_index(layer_idx)
    pages, scales = manager.get_index_k_pages(layer_idx), manager.get_index_k_scales(layer_idx)
    write_paged(pages, metadata, pool, 0, index_k, scales)


def gather_index_k(layer_idx: int, metadata: AttentionMetadata, seq: int) -> torch.Tensor:
    """Every cached index-K of sequence ``seq``: ``[kv_len, Di]``."""
    manager = metadata.kv_cache_manager
    pool = manager.layer_pool_index(layer_idx)
    pages, scales = manager.get_index_k_pages(layer_idx), manager.get_index_k_scales(layer_idx)
    return gather_paged(pages, metadata, pool, 0, seq, scales)[:, 0]


def msa_paged_attention(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    msa: MsaInputs,
    metadata: AttentionMetadata,
    cfg: MsaConfig,
    scale: float,
) -> torch.Tensor:
    """Write K, V and index-K of the step into the cache, then MSA per query.

    q: ``[n, H, D]``; k, v: ``[n, Hkv, D]``; ``msa`` over the same ``n`` tokens (``index_q [n,
    Hkv, Di]``, ``index_k [n, 1, Di]``).
    """
    if msa.index_q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"index_q has {msa.index_q.shape[-2]} index heads for {k.shape[-2]} KV heads: the "
            "indexer selects per KV group (index_n_heads == num_key_value_heads)"
        )
    write_msa_step(layer_idx, k, v, msa.index_k, metadata)
    out = torch.empty_like(q)
    for seq in range(metadata.num_seqs):
        span = metadata.seq_token_slice(seq)
        pos = metadata.position_ids[span]
        k_all, v_all = gather_kv(layer_idx, metadata, seq)
        ik_all = gather_index_k(layer_idx, metadata, seq)  # [L, Di]
        scores = index_block_scores(msa.index_q[span], ik_all, pos, cfg.block_size)
        selected = select_blocks(scores, pos, cfg)
        out[span] = sparse_attention(q[span], k_all, v_all, pos, selected, cfg.block_size, scale)
    return out
