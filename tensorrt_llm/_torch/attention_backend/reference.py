"""Torch reference paged attention: the CPU path and the oracle for GPU kernels. Models reach it
through ``VanillaAttentionBackend`` (``vanilla.py``, ``attn_backend="VANILLA"``), never directly.

Every read and write goes through what the metadata's manager publishes (``interface.py``): page
tensors, their scales in an FP8 cache, ``tokens_per_block`` and the block table. Nothing here knows
a slot layout. Attention always reads K and V back from the cache, the step's own tokens' too, so a
prefix computed now, reused, transferred or verified is read the same way.
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, ScalePages
from tensorrt_llm._torch.attention_backend.kv_quant import dequantize_rows, quantize_rows


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
    scales: ScalePages | None = None,
) -> None:
    """Store ``values`` ``[num_tokens, heads, dim]`` at the step's positions of ``pages``, as FP8
    rows with their ``scales`` when given."""
    page, offset = token_pages(metadata, pool, lane)
    page, offset = page.to(pages.device), offset.to(pages.device)
    if scales is None:
        pages[page, offset] = values.to(pages.dtype)
        return
    rows, row_scales = quantize_rows(values)
    pages[page, offset] = rows
    scales.tensor[page // scales.page_units, page % scales.page_units, offset] = row_scales


def gather_paged(
    pages: torch.Tensor,
    metadata: AttentionMetadata,
    pool: int,
    lane: int,
    seq: int,
    scales: ScalePages | None = None,
) -> torch.Tensor:
    """All cached positions of sequence ``seq``: ``[kv_len, heads, dim]`` (FP8 rows dequantized to
    float32 with their ``scales`` when given)."""
    kv_len = int(metadata.kv_lens_cpu[seq])
    tpb = metadata.tokens_per_block
    num_blocks = -(-kv_len // tpb)
    table = metadata.kv_cache_block_offsets[pool, seq, lane, :num_blocks].long()
    table = table.to(pages.device)
    blocks = pages[table]  # [num_blocks, tokens_per_block, heads, dim]
    if scales is not None:
        blocks = dequantize_rows(blocks, scales.of(table))
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
    write_kv(layer_idx, k, v, metadata)
    out = torch.empty_like(q)
    for seq in range(metadata.num_seqs):
        span = metadata.seq_token_slice(seq)
        k_all, v_all = gather_kv(layer_idx, metadata, seq)
        out[span] = causal_attention(q[span], k_all, v_all, metadata.position_ids[span], scale)
    return out


def write_kv(layer_idx: int, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Store the step's K and V ``[num_tokens, num_kv_heads, head_dim]`` of layer ``layer_idx``
    through the manager attached to ``metadata`` (as FP8 rows and scales in an FP8 cache)."""
    manager = metadata.kv_cache_manager
    pool = manager.layer_pool_index(layer_idx)
    k_pages, v_pages = manager.get_kv_pages(layer_idx)
    k_scales, v_scales = manager.get_kv_scales(layer_idx) or (None, None)
    write_paged(k_pages, metadata, pool, 0, k, k_scales)
    write_paged(v_pages, metadata, pool, 1, v, v_scales)


def gather_kv(
    layer_idx: int, metadata: AttentionMetadata, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every cached K and V of sequence ``seq`` on layer ``layer_idx``: ``[kv_len, Hkv, D]`` each."""
    manager = metadata.kv_cache_manager
    pool = manager.layer_pool_index(layer_idx)
    k_pages, v_pages = manager.get_kv_pages(layer_idx)
    k_scales, v_scales = manager.get_kv_scales(layer_idx) or (None, None)
    return (
        gather_paged(k_pages, metadata, pool, 0, seq, k_scales),
        gather_paged(v_pages, metadata, pool, 1, seq, v_scales),
    )
