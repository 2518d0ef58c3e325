"""MiniMax sparse attention (MSA): block selection by a light indexer, then attention over the blocks.

For a query at position p, with ``B = block_size`` (128 in M3)::

    token score  s[p, j] = sum_h w[p, h] * relu(q_idx[p, h] . k_idx[j]) / sqrt(index_head_dim),  j <= p
    block score  S[p, b] = max over j in block b (j <= p) of s[p, j]
    local        blocks p//B - num_local_blocks + 1 .. p//B        (always attended)
    selected     local  U  top-``topk_blocks`` of the earlier blocks by S[p, .] (ties: earlier block)
    attention    ordinary causal attention restricted to keys in selected blocks

Each query (every verify token of a speculative step included) selects its own blocks. While a
sequence has at most ``topk_blocks + num_local_blocks`` blocks, everything is selected and MSA equals
dense attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.reference import gather_paged, write_paged


@dataclass(frozen=True)
class MsaConfig:
    """``sparse_attention_config`` of a MiniMax-M3 ``config.json``."""

    index_n_heads: int
    index_head_dim: int
    topk_blocks: int
    block_size: int = 128
    num_local_blocks: int = 1
    num_dense_layers: int = 1  # the first layers are dense; the rest use MSA

    def __post_init__(self) -> None:
        for name in (
            "index_n_heads",
            "index_head_dim",
            "topk_blocks",
            "block_size",
            "num_local_blocks",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"sparse_attention_config.{name}={value!r} must be a positive int")
        if not isinstance(self.num_dense_layers, int) or self.num_dense_layers < 0:
            raise ValueError(
                f"sparse_attention_config.num_dense_layers={self.num_dense_layers!r} must be >= 0"
            )


@dataclass(frozen=True)
class MsaInputs:
    """What MSA's light indexer computed for the step's tokens (``...`` is the token dims of ``q``).

    index_q: ``[..., index_n_heads, index_head_dim]``; index_w: ``[..., index_n_heads]`` (per-head
    weights, already divided by ``sqrt(index_n_heads)``); index_k: ``[..., 1, index_head_dim]`` (the
    one shared index-K head, cached per token like K).
    """

    index_q: torch.Tensor
    index_w: torch.Tensor
    index_k: torch.Tensor


def index_scores(
    index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor
) -> torch.Tensor:
    """``index_q [n, Hi, Di]``, ``index_w [n, Hi]``, ``index_k [L, Di]`` -> token scores ``[n, L]``."""
    dots = torch.einsum("nhd,ld->nhl", index_q.float(), index_k.float()) / math.sqrt(
        index_q.shape[-1]
    )
    return torch.einsum("nhl,nh->nl", torch.relu(dots), index_w.float())


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, cfg: MsaConfig) -> torch.Tensor:
    """Token scores ``[n, L]`` and query positions ``[n]`` -> selected blocks ``[n, num_blocks]`` (bool)."""
    n, length = scores.shape
    bs = cfg.block_size
    num_blocks = -(-length // bs)
    keys = torch.arange(num_blocks * bs, device=scores.device)
    padded = torch.full((n, num_blocks * bs), float("-inf"), device=scores.device)
    padded[:, :length] = scores
    padded = padded.masked_fill(keys[None, :] > q_pos[:, None], float("-inf"))
    block_scores = padded.view(n, num_blocks, bs).amax(dim=-1)  # [n, num_blocks]
    blocks = torch.arange(num_blocks, device=scores.device)
    q_block = (q_pos // bs)[:, None]
    local = (blocks[None, :] <= q_block) & (blocks[None, :] > q_block - cfg.num_local_blocks)
    earlier = blocks[None, :] <= q_block - cfg.num_local_blocks
    candidates = block_scores.masked_fill(~earlier, float("-inf"))
    k = min(cfg.topk_blocks, num_blocks)
    # a stable descending sort: equal scores go to the earlier block
    top_scores, top_idx = torch.sort(candidates, dim=-1, descending=True, stable=True)
    chosen = torch.zeros_like(local)
    chosen.scatter_(1, top_idx[:, :k], top_scores[:, :k] > float("-inf"))
    return chosen | local


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    selected: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q [n, H, D]`` over only the selected blocks of ``k, v [L, Hkv, D]``.

    Gathers, per query, the keys of its selected blocks (``[n, S * block_size]`` indices, padded with
    -1), so the work is proportional to the selected blocks, not to ``L``.
    """
    n, num_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    num_sel = int(selected.sum(dim=1).max()) if n else 0
    # block ids of each query's selection, padded with -1: [n, num_sel]
    order = torch.argsort((~selected).to(torch.int8), dim=1, stable=True)[:, :num_sel]
    block_ids = torch.where(torch.gather(selected, 1, order), order, -1)
    token_ids = block_ids[:, :, None] * block_size + torch.arange(block_size, device=q.device)
    token_ids = torch.where(block_ids[:, :, None] >= 0, token_ids, -1).reshape(
        n, -1
    )  # [n, num_sel * bs]
    valid = (token_ids >= 0) & (token_ids < length) & (token_ids <= q_pos[:, None])
    gather_ids = token_ids.clamp(0, max(length - 1, 0))
    keys, values = k[gather_ids], v[gather_ids]  # [n, S*bs, Hkv, D]
    if num_heads != num_kv_heads:
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=2)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=2)
    scores = torch.einsum("nhd,nshd->nhs", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("nhs,nshd->nhd", torch.softmax(scores, dim=-1), values.float()).to(q.dtype)


def write_msa_step(
    layer_idx: int,
    k: torch.Tensor,
    v: torch.Tensor,
    index_k: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """Store the step's K, V ``[n, Hkv, D]`` and index-K ``[n, 1, Di]`` of an MSA layer at the
    step's positions, through the manager attached to ``metadata``."""
    manager = metadata.kv_cache_manager
    pool = manager.layer_pool_index(layer_idx)
    k_pages, v_pages = manager.get_kv_pages(layer_idx)
    write_paged(k_pages, metadata, pool, 0, k)
    write_paged(v_pages, metadata, pool, 1, v)
    write_paged(manager.get_index_k_pages(layer_idx), metadata, pool, 0, index_k)


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

    q: ``[n, H, D]``; k, v: ``[n, Hkv, D]``; ``msa`` over the same ``n`` tokens (``index_k [n, 1, Di]``).
    """
    write_msa_step(layer_idx, k, v, msa.index_k, metadata)
    manager = metadata.kv_cache_manager
    pool = manager.layer_pool_index(layer_idx)
    k_pages, v_pages = manager.get_kv_pages(layer_idx)
    ik_pages = manager.get_index_k_pages(layer_idx)
    out = torch.empty_like(q)
    for seq in range(metadata.num_seqs):
        span = metadata.seq_token_slice(seq)
        pos = metadata.position_ids[span]
        k_all = gather_paged(k_pages, metadata, pool, 0, seq)
        v_all = gather_paged(v_pages, metadata, pool, 1, seq)
        ik_all = gather_paged(ik_pages, metadata, pool, 0, seq)[:, 0]  # [L, Di]
        scores = index_scores(msa.index_q[span], msa.index_w[span], ik_all)  # [n_seq, L]
        selected = select_blocks(scores, pos, cfg)
        out[span] = sparse_attention(q[span], k_all, v_all, pos, selected, cfg.block_size, scale)
    return out
