"""Torch reference paged attention: the CPU path and the oracle for GPU kernels. Models reach it
through ``VanillaAttentionBackend`` (``vanilla.py``, ``attn_backend="VANILLA"``), never directly.

Every read and write goes through what the metadata's manager publishes (``interface.py``): page
tensors, ``tokens_per_block`` and the block table. Nothing here knows a slot layout.
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata


def token_pages(
    metadata: AttentionMetadata, pool: int, lane: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page index and in-page offset of every token of the step, for K (lane 0) or V (lane 1)."""
    tpb = metadata.tokens_per_block
    pos = metadata.position_ids
    table = metadata.kv_cache_block_offsets[pool, :, lane].long()  # [num_seqs, max_blocks]
    return table[metadata.token_seq_idx, pos // tpb], pos % tpb


def write_paged(
    pages: torch.Tensor,
    metadata: AttentionMetadata,
    pool: int,
    lane: int,
    values: torch.Tensor,
) -> None:
    """Store ``values`` ``[num_tokens, heads, dim]`` at the step's positions of ``pages``."""
    page, offset = token_pages(metadata, pool, lane)
    pages[page.to(pages.device), offset.to(pages.device)] = values.to(pages.dtype)


def gather_paged(
    pages: torch.Tensor, metadata: AttentionMetadata, pool: int, lane: int, seq: int
) -> torch.Tensor:
    """All cached positions of sequence ``seq``: ``[kv_len, heads, dim]``."""
    kv_len = int(metadata.kv_lens_cpu[seq])
    tpb = metadata.tokens_per_block
    num_blocks = -(-kv_len // tpb)
    table = metadata.kv_cache_block_offsets[pool, seq, lane, :num_blocks].long()
    blocks = pages[table.to(pages.device)]  # [num_blocks, tokens_per_block, heads, dim]
    return blocks.reshape(num_blocks * tpb, *blocks.shape[2:])[:kv_len]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [n, H, D]`` against ``k, v [L, Hkv, D]`` (key j at position j), each query seeing keys at
    positions <= its own (and, if given, where ``key_mask`` is true: ``[n, L]`` for every head, or
    ``[n, Hkv, L]`` per KV group). Returns ``[n, H, D]``."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    if group != 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [H, n, L]
    allowed = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None].to(
        q.device
    )  # [n, L]
    allowed = allowed[None]  # [1, n, L]
    if key_mask is not None:
        if key_mask.dim() == 3:  # [n, Hkv, L] -> [H, n, L]
            key_mask = key_mask.repeat_interleave(group, dim=1).transpose(0, 1)
        allowed = allowed & key_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def paged_attention(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the step's K/V into the cache, then attend every query to its sequence's cached keys.

    q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``.
    """
    manager = metadata.kv_cache_manager
    pool = manager.layer_pool_index(layer_idx)
    k_pages, v_pages = manager.get_kv_pages(layer_idx)
    write_paged(k_pages, metadata, pool, 0, k)
    write_paged(v_pages, metadata, pool, 1, v)
    out = torch.empty_like(q)
    for seq in range(metadata.num_seqs):
        span = metadata.seq_token_slice(seq)
        k_all = gather_paged(k_pages, metadata, pool, 0, seq)
        v_all = gather_paged(v_pages, metadata, pool, 1, seq)
        out[span] = causal_attention(q[span], k_all, v_all, metadata.position_ids[span], scale)
    return out
