"""MiniMax sparse attention (MSA) on Triton: launchers and the public op.

``triton_msa_attend`` is the attention half of the torch reference
``sparse/minimax_m3/msa.py::msa_paged_attention`` (the oracle; the backend writes the step's K, V
and index-K first), with no host sync and no loop over the batch. The indexer selects per KV group (``G`` groups: index head ``g`` for KV head ``g``,
whose query heads ``g * GROUP .. g * GROUP + GROUP - 1`` attend group ``g``'s blocks). Its steps,
each a launcher usable (and tested) on its own::

    write K, V, index-K      the dense write kernel (``write_index_k_pages``: index-K as a K
                             lane of its own pages; FP8 rows and scales in an FP8 cache)
    msa_block_scores         [num_tokens, G, num_key_blocks] fp32: raw index dot products, max
                             per key block (``index_block_scores``)
    msa_select_blocks        MsaSelection: [num_tokens, G, num_key_blocks] bool
                             (``select_blocks``), and per query tile and group the union of its
                             tokens' blocks
    msa_sparse_attention     [num_tokens, H, D]: each (tile, KV head) visits its group's union
                             once, each row keeps only the blocks its own token selected

Grid sizes come from host metadata (``seq_lens``, ``kv_lens_cpu``); every per-token and per-sequence
quantity the kernels read is a device tensor of the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, ScalePages
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (
    MsaConfig,
    MsaInputs,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.triton_msa_kernels import (
    INTERPRETED,
    _msa_block_scores_kernel,
    _msa_select_kernel,
    _msa_sparse_attention_kernel,
)
from tensorrt_llm._torch.attention_backend.triton.addressing import index_k_paged_kv
from tensorrt_llm._torch.attention_backend.triton.launch import (
    launch_split_reduce,
    split_partials,
)
from tensorrt_llm._torch.attention_backend.triton.ops import (
    choose_num_splits,
    num_sms,
    write_kv_pages,
)

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# the selection's key of a -inf score (``_msa_select_kernel``): -inf's order-preserving int32
# (its bits, negative, with the magnitude bits flipped) above any block's rank (< 2^31)
_NO_BLOCK = ((-(2**23) ^ 0x7FFFFFFF) << 32) | 0x7FFFFFFF


def _pad(n: int) -> int:
    """A tile extent for ``n``: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(n))


def _dot_options(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How a kernel multiplies ``a`` by ``b``: as they are when both have the same 16-bit type
    (compiled kernels only), else in fp32 with full-precision products (``ieee``: no TF32)."""
    fp32 = INTERPRETED or not (a.dtype == b.dtype and a.dtype in _LOW_PRECISION)
    return {"DOT_FP32": fp32, "DOT_PRECISION": "ieee" if fp32 else "tf32"}


@dataclass(frozen=True)
class PagedBatch:
    """The step's batch as the MSA kernels address it (``AttentionMetadata`` layout).

    Device: ``table_k`` / ``table_v`` ``[num_seqs, max_pages]`` int32 (lanes 0 and 1 of one pool's
    block table: K and index-K pages, V pages), ``cu_seqlens_q`` ``[num_seqs + 1]`` int32,
    ``position_ids`` ``[num_tokens]``. Host ints size the grids.
    """

    table_k: torch.Tensor
    table_v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    position_ids: torch.Tensor
    tokens_per_page: int
    max_q_len: int
    max_kv_len: int

    @classmethod
    def from_metadata(cls, metadata: AttentionMetadata, pool: int) -> PagedBatch:
        table = metadata.kv_cache_block_offsets[pool]  # [>= num_seqs, 2, max_pages]
        return cls(
            table_k=table[:, 0],
            table_v=table[:, 1],
            cu_seqlens_q=metadata.cu_seqlens_q,
            position_ids=metadata.position_ids,
            tokens_per_page=metadata.tokens_per_block,
            max_q_len=max(metadata.seq_lens, default=0),
            max_kv_len=metadata.max_kv_len,
        )

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def _scale_args(*scales: ScalePages | None, pages: torch.Tensor) -> tuple:
    """The scale arguments of a kernel: each tensor, ``page_units``, the slot, page and row
    strides; for unscaled pages, ``pages`` as never-read dummies."""
    if scales[0] is None:
        return (*[pages] * len(scales), 1, 0, 0, 0)
    if len({(s.tensor.stride()[:3], s.page_units) for s in scales}) != 1:
        raise ValueError("the scale pages of one kernel must share strides and page units")
    return (*(s.tensor for s in scales), scales[0].page_units, *scales[0].tensor.stride()[:3])


def _check_pages(name: str, pages: torch.Tensor, batch: PagedBatch, heads: int, dim: int) -> None:
    want = (batch.tokens_per_page, heads, dim)
    if pages.dim() != 4 or tuple(pages.shape[1:]) != want:
        raise ValueError(
            f"{name} pages of shape {tuple(pages.shape)}: expected [num_pages, {want[0]}, "
            f"{want[1]}, {want[2]}] (tokens_per_block, heads, head_dim)"
        )


def attention_tile_tokens(max_q_len: int, group: int) -> int:
    """Query tokens per tile: the tile's ``tokens x next_pow2(group)`` rows fill at most 64 (or one
    token's heads), and no more tokens than the longest sequence of the step has."""
    per_tile = max(1, 64 // triton.next_power_of_2(group))
    return min(triton.next_power_of_2(max(max_q_len, 1)), per_tile)


def write_index_k_pages(layer_idx: int, index_k: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Store the step's index-K ``[num_tokens, 1, Di]`` in one launch: the Triton twin of
    ``msa.write_index_k``."""
    ik = index_k_paged_kv(metadata.kv_cache_manager, layer_idx, metadata.kv_cache_block_offsets)
    write_kv_pages(index_k, None, ik, metadata.position_ids, metadata.token_seq_idx)


def msa_block_scores(
    index_q: torch.Tensor,
    index_k_pages: torch.Tensor,
    batch: PagedBatch,
    block_size: int,
    index_k_scales: ScalePages | None = None,
) -> torch.Tensor:
    """Indexer scores of every step token and KV group against every cached key of its sequence
    at a position ``<=`` its own (the raw fp32 dot product ``index_q[t, g] . index_k[j]``),
    max-pooled per key block of ``block_size``.

    index_q ``[num_tokens, G, Di]`` (one index head per KV group), index-K pages ``[num_pages,
    tokens_per_block, 1, Di]`` (FP8 with ``index_k_scales``) -> fp32 ``[num_tokens, G,
    cdiv(max_kv_len, block_size)]``; -inf for a block with no visible key.
    """
    num_tokens, num_groups, index_dim = index_q.shape
    _check_pages("index-K", index_k_pages, batch, 1, index_dim)
    num_key_blocks = triton.cdiv(batch.max_kv_len, block_size)
    # [num_tokens, G, num_key_blocks]; the kernel writes only the blocks a query tile can see
    out = torch.full(
        (num_tokens, num_groups, num_key_blocks),
        float("-inf"),
        dtype=torch.float32,
        device=index_q.device,
    )
    if num_tokens == 0 or num_groups == 0 or num_key_blocks == 0:
        return out
    # rows of (token, group) pairs, as msa_sparse_attention's rows are (token, query head) pairs
    tile_tokens = attention_tile_tokens(batch.max_q_len, num_groups)
    groups_pad = triton.next_power_of_2(num_groups)
    grid = (batch.num_seqs, triton.cdiv(batch.max_q_len, tile_tokens), num_key_blocks)
    ik = index_k_pages[:, :, 0]  # [num_pages, tokens_per_block, Di]
    _msa_block_scores_kernel[grid](
        index_q, *index_q.stride(),  # [num_tokens, G, Di]
        ik, *ik.stride(),  # [num_pages, tokens_per_block, Di]
        *_scale_args(index_k_scales, pages=ik),
        batch.table_k, *batch.table_k.stride(),  # [num_seqs, max_pages]
        batch.cu_seqlens_q, batch.position_ids,
        out, *out.stride(),  # [num_tokens, G, num_key_blocks]
        NUM_GROUPS=num_groups, GROUPS_PAD=groups_pad,
        INDEX_DIM=index_dim, INDEX_DIM_PAD=_pad(index_dim),
        BLOCK_SIZE=block_size, TOKENS_PER_PAGE=batch.tokens_per_page, TILE_TOKENS=tile_tokens,
        ROWS=max(16, tile_tokens * groups_pad), BLOCK_N=min(128, _pad(block_size)),
        **_dot_options(index_q, index_q if index_k_scales else ik),
        SCALED=index_k_scales is not None,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class MsaSelection:
    """The key blocks every step token attends per KV group, and per query tile and group the
    union of its tokens' blocks.

    mask: bool ``[num_tokens, G, num_key_blocks]``, the same as ``select_blocks`` per sequence;
    tile_blocks: int32 ``[num_tile_ids, G, num_key_blocks]``, the blocks a tile's tokens selected
    for group ``g`` ascending in the first ``tile_counts[tile_id, g]`` entries of
    ``tile_blocks[tile_id, g]`` (``tile_id``: ``triton_msa_kernels.py``); ``tile_counts`` int32
    ``[num_tile_ids, G]``; ``tile_tokens`` tokens per tile.
    """

    mask: torch.Tensor
    tile_blocks: torch.Tensor
    tile_counts: torch.Tensor
    tile_tokens: int


def msa_select_blocks(
    block_scores: torch.Tensor, batch: PagedBatch, cfg: MsaConfig, tile_tokens: int
) -> MsaSelection:
    """Per token and KV group (``select_blocks``): the ``cfg.local_blocks`` forced blocks ending at
    the token's own, counted among the top ``cfg.topk_blocks`` blocks by score (equal scores go to
    the earlier block; only finite scores count).

    block_scores ``[num_tokens, G, num_key_blocks]`` (``msa_block_scores``); query tiles of
    ``tile_tokens`` (a power of two) tokens, as ``msa_sparse_attention`` will visit them.
    """
    if tile_tokens <= 0 or tile_tokens & (tile_tokens - 1):
        raise ValueError(f"tile_tokens={tile_tokens} must be a power of two")
    num_tokens, num_groups, num_key_blocks = block_scores.shape
    device = block_scores.device
    num_tile_ids = batch.num_seqs + num_tokens // tile_tokens + 1
    # every entry of a token's rows is written; tile ids of no tile are never read
    mask = torch.empty(num_tokens, num_groups, num_key_blocks, dtype=torch.int8, device=device)
    tile_blocks = torch.empty(
        num_tile_ids, num_groups, num_key_blocks, dtype=torch.int32, device=device
    )
    tile_counts = torch.empty(num_tile_ids, num_groups, dtype=torch.int32, device=device)
    selection = MsaSelection(mask.view(torch.bool), tile_blocks, tile_counts, tile_tokens)
    if num_tokens == 0 or num_groups == 0 or num_key_blocks == 0:
        return selection
    block_b = _pad(num_key_blocks)
    sub_tokens = max(2, min(tile_tokens, 4096 // block_b))
    grid = (batch.num_seqs, triton.cdiv(batch.max_q_len, tile_tokens), num_groups)
    _msa_select_kernel[grid](
        block_scores, *block_scores.stride(),  # [num_tokens, G, num_key_blocks]
        mask, *mask.stride(),  # [num_tokens, G, num_key_blocks]
        tile_blocks, *tile_blocks.stride(),  # [num_tile_ids, G, num_key_blocks]
        tile_counts, *tile_counts.stride(),  # [num_tile_ids, G]
        batch.cu_seqlens_q, batch.position_ids, num_key_blocks,
        BLOCK_SIZE=cfg.block_size, TOPK=cfg.topk_blocks, NUM_LOCAL=cfg.local_blocks,
        TILE_TOKENS=tile_tokens, SUB_TOKENS=sub_tokens, BLOCK_B=block_b, NO_BLOCK=_NO_BLOCK,
        num_warps=8 if sub_tokens * block_b >= 2048 else 4,
    )  # fmt: skip
    return selection


def msa_sparse_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    selection: MsaSelection,
    batch: PagedBatch,
    block_size: int,
    scale: float,
    num_splits: int = 1,
    kv_scales: tuple[ScalePages, ScalePages] | None = None,
) -> torch.Tensor:
    """Attention of each token's query heads over only the keys (positions ``<=`` its own) of the
    key blocks the token selected for their KV group, read through the block table (GQA: heads
    ``g*GROUP .. g*GROUP+GROUP-1`` share KV head ``g`` and group ``g``'s selection).
    ``num_splits > 1`` spreads each tile's blocks of the group over that many programs and
    combines their partial outputs (flash decoding: a small decode batch then fills the GPU).

    q ``[num_tokens, H, D]``, K / V pages ``[num_pages, tokens_per_block, Hkv, D]``, a selection
    of ``Hkv`` groups (``msa_select_blocks``) -> ``[num_tokens, H, D]`` in ``q``'s dtype. FP8
    pages come with ``kv_scales`` (K's and V's).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = _check_group(num_heads, num_kv_heads)
    if selection.mask.dim() != 3 or selection.mask.shape[:2] != (num_tokens, num_kv_heads):
        raise ValueError(
            f"selection mask of shape {tuple(selection.mask.shape)}: expected [num_tokens="
            f"{num_tokens}, num_kv_heads={num_kv_heads}, num_key_blocks]"
        )
    _check_pages("K", k_pages, batch, num_kv_heads, head_dim)
    _check_pages("V", v_pages, batch, num_kv_heads, head_dim)
    if k_pages.stride() != v_pages.stride():
        raise ValueError(
            f"K pages strides {k_pages.stride()} != V pages strides {v_pages.stride()}: the kernel "
            "reads both with one layout"
        )
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be a positive int")
    out = torch.empty_like(q)  # [num_tokens, H, D]
    if num_tokens == 0:
        return out
    split = num_splits > 1
    partial, lse = split_partials(q, num_splits) if split else (out[None], out[None, :, :, 0])
    tile = selection.tile_tokens
    group_pad = triton.next_power_of_2(group)
    grid = (batch.num_seqs, triton.cdiv(batch.max_q_len, tile), num_kv_heads * num_splits)
    sel = selection
    _msa_sparse_attention_kernel[grid](
        q, *q.stride(),  # [num_tokens, H, D]
        out, *out.stride(),  # [num_tokens, H, D]
        k_pages, v_pages, *k_pages.stride(),  # [num_pages, tokens_per_block, Hkv, D]
        batch.table_k, batch.table_v, *batch.table_k.stride(),  # [num_seqs, max_pages]
        *_scale_args(*(kv_scales or (None, None)), pages=k_pages),
        sel.mask.view(torch.int8), *sel.mask.stride(),  # [num_tokens, Hkv, num_key_blocks]
        sel.tile_blocks, *sel.tile_blocks.stride(),  # [num_tile_ids, Hkv, num_key_blocks]
        sel.tile_counts, *sel.tile_counts.stride(),  # [num_tile_ids, Hkv]
        batch.cu_seqlens_q, batch.position_ids,
        partial, *partial.stride(),  # [num_splits, num_tokens, H, D]
        lse, *lse.stride(),  # [num_splits, num_tokens, H]
        scale, num_splits,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=_pad(head_dim),
        BLOCK_SIZE=block_size, TOKENS_PER_PAGE=batch.tokens_per_page, TILE_TOKENS=tile,
        ROWS=max(16, tile * group_pad), BLOCK_N=min(64, _pad(block_size)),
        **_dot_options(q, q if kv_scales else k_pages), SPLIT=split, SCALED=kv_scales is not None,
    )  # fmt: skip
    if split:
        launch_split_reduce(partial, lse, out)
    return out


def _check_group(num_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)"
        )
    return num_heads // num_kv_heads


def _check_index_heads(index_q: torch.Tensor, num_kv_heads: int) -> None:
    if index_q.dim() != 3 or index_q.shape[1] != num_kv_heads:
        raise ValueError(
            f"index_q of shape {tuple(index_q.shape)}: expected [num_tokens, {num_kv_heads}, "
            "index_head_dim], one index head per KV head (the indexer selects per KV group)"
        )


def msa_num_splits(
    batch: PagedBatch, cfg: MsaConfig, num_kv_heads: int, tile_tokens: int, device: torch.device
) -> int:
    """The splits ``triton_msa_attend`` gives the sparse attention: a (tile, KV head) reads at most
    its tokens' selected blocks (one token's at decode)."""
    visited = cfg.topk_blocks * cfg.block_size
    num_programs = batch.num_seqs * triton.cdiv(batch.max_q_len, tile_tokens) * num_kv_heads
    return choose_num_splits(num_programs, min(batch.max_kv_len, visited), num_sms(device))


def triton_msa_attend(
    layer_idx: int,
    q: torch.Tensor,
    msa: MsaInputs,
    metadata: AttentionMetadata,
    cfg: MsaConfig,
    scale: float,
) -> torch.Tensor:
    """MSA of the step's queries over the cache once the step's K, V and index-K are written
    (the backend writes them: ``msa_backend.TritonMsaBackend``). q ``[num_tokens, H, D]``,
    ``index_q [num_tokens, Hkv, Di]`` (one index head per KV group) -> like q."""
    if q.dim() != 3 or q.shape[0] != metadata.num_tokens:
        raise ValueError(
            f"q of shape {tuple(q.shape)}: expected [num_tokens={metadata.num_tokens}, heads, "
            "head_dim]"
        )
    manager = metadata.kv_cache_manager
    pool = manager.layer_pool_index(layer_idx)
    k_pages, v_pages = manager.get_kv_pages(layer_idx)
    group = _check_group(q.shape[1], k_pages.shape[2])
    _check_index_heads(msa.index_q, k_pages.shape[2])
    batch = PagedBatch.from_metadata(metadata, pool)
    block_scores = msa_block_scores(
        msa.index_q,
        manager.get_index_k_pages(layer_idx),
        batch,
        cfg.block_size,
        manager.get_index_k_scales(layer_idx),
    )  # [num_tokens, Hkv, num_key_blocks]
    tile_tokens = attention_tile_tokens(batch.max_q_len, group)
    selection = msa_select_blocks(block_scores, batch, cfg, tile_tokens)
    num_splits = msa_num_splits(batch, cfg, k_pages.shape[2], tile_tokens, q.device)
    kv_scales = manager.get_kv_scales(layer_idx)
    return msa_sparse_attention(
        q, k_pages, v_pages, selection, batch, cfg.block_size, scale, num_splits, kv_scales
    )
