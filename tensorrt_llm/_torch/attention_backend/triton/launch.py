"""Launchers: tile sizes, grids and strides for the kernels. Inputs are trusted (``ops.py`` checks
them); every tensor's strides are passed in the order of the shape written beside it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from tensorrt_llm._torch.attention_backend.triton.addressing import PagedKV
from tensorrt_llm._torch.attention_backend.triton.attention_kernel import (
    paged_attention_kernel,
    split_reduce_kernel,
)
from tensorrt_llm._torch.attention_backend.triton.kv_write_kernel import (
    kv_write_fp8_kernel,
    kv_write_kernel,
)
from tensorrt_llm._torch.attention_backend.triton.step import StepBatch

NUM_WARPS = 4


def is_interpreted() -> bool:
    """Whether the kernels were built under ``TRITON_INTERPRET=1`` (it is read at import time)."""
    return type(paged_attention_kernel).__name__ == "InterpretedFunction"


def launch_kv_write(
    k: torch.Tensor,
    v: torch.Tensor | None,
    kv: PagedKV,
    position_ids: torch.Tensor,
    token_seq_idx: torch.Tensor,
) -> None:
    """One launch storing every token's K and V (K alone when ``v`` is None): ``BLOCK_T`` tokens x
    all heads per program."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    write_v = v is not None
    v = k if v is None else v  # never read without WRITE_V
    if kv.scaled:
        launch_kv_write_fp8(k, v, kv, position_ids, token_seq_idx, write_v)
        return
    num_hd = num_kv_heads * head_dim
    block_hd = triton.next_power_of_2(num_hd)
    block_t = max(1, min(64, 4096 // block_hd))
    a = kv.addressing
    kv_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, kv.k_pages, kv.v_pages, kv.block_table, position_ids, token_seq_idx,
        num_tokens, a.page_units, a.v_page_offset,
        *k.stride(),  # [num_tokens, num_kv_heads, head_dim]
        *v.stride(),  # [num_tokens, num_kv_heads, head_dim]
        *kv.k_pages.stride(),  # [num_pages, page_tokens, num_kv_heads, head_dim]
        *kv.v_pages.stride(),  # [num_pages, page_tokens, num_kv_heads, head_dim]
        *kv.block_table.stride(),  # [num_seqs, 2, max_blocks]
        HEAD_DIM=head_dim, NUM_HD=num_hd, BLOCK_T=block_t, BLOCK_HD=block_hd,
        BLOCK_TOKENS=a.block_tokens, PAGE_TOKENS=a.page_tokens, WRITE_V=write_v,
        num_warps=NUM_WARPS,
    )  # fmt: skip


def launch_kv_write_fp8(
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    position_ids: torch.Tensor,
    token_seq_idx: torch.Tensor,
    write_v: bool,
) -> None:
    """FP8 pages: ``BLOCK_T`` tokens of one KV head per program, rows quantized with their scales."""
    num_tokens, num_kv_heads, head_dim = k.shape
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(64, 4096 // block_d))
    a = kv.addressing
    kv_write_fp8_kernel[(triton.cdiv(num_tokens, block_t), num_kv_heads)](
        k, *k.stride(), v, *v.stride(),  # [num_tokens, num_kv_heads, head_dim]
        kv.k_pages, *kv.k_pages.stride(),  # [num_pages, page_tokens, num_kv_heads, head_dim]
        kv.v_pages, *kv.v_pages.stride(),
        *kv.scale_args(),
        kv.block_table, *kv.block_table.stride(),  # [num_seqs, 2, max_blocks]
        position_ids, token_seq_idx, num_tokens, a.page_units, a.v_page_offset,
        HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_D=block_d,
        BLOCK_TOKENS=a.block_tokens, PAGE_TOKENS=a.page_tokens, WRITE_V=write_v,
        num_warps=NUM_WARPS,
    )  # fmt: skip


@dataclass(frozen=True)
class AttentionTiles:
    block_m: int  # query rows ((token, head) pairs of one GQA group) per program
    block_n: int  # keys per inner step
    block_d: int  # head_dim padded to a power of two >= 16 (tl.dot's minimum)
    num_query_tiles: int  # programs along the query axis per sequence (the longest sequence's)
    num_warps: int = NUM_WARPS
    num_stages: int = 3  # software pipelining depth of the key loop


def attention_tiles(
    max_query_len: int, group: int, head_dim: int, itemsize: int = 2, split: bool = False
) -> AttentionTiles:
    """Tiles for a step of ``itemsize``-byte inputs. Decode needs few query rows (``(1 + drafts) *
    group``): 16, 32 or 64 rows, by 128 keys, in 3 stages when a program reads a whole sequence
    and 2 when it reads one split of it (``split``; with ``ops.decode_num_splits``, 8 x 32K of the
    draft geometry through the 32-token view reads at 0.95 of SDPA's bandwidth on an H200:
    ``benchmarks/bench_attention.py``). Prefill of 16-bit inputs takes 128 x 128 tiles on 8 warps
    (8k-token causal prefill: 301 TFLOP/s against 250 with 64 x 64 tiles); fp32 and head_dim
    above 128 keep smaller tiles and fewer stages to fit shared memory."""
    rows = max_query_len * group
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_tiles = triton.cdiv(max(rows, 1), 128)
    if rows > 64 and itemsize == 2 and block_d <= 128:
        return AttentionTiles(128, 128, block_d, num_tiles, num_warps=8, num_stages=3)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 32 if block_d > 128 else 64 if itemsize > 2 else 128
    stages = 2 if itemsize > 2 or split else 3
    return AttentionTiles(
        block_m, block_n, block_d, triton.cdiv(max(rows, 1), block_m), num_stages=stages
    )


def launch_paged_attention(
    q: torch.Tensor,
    kv: PagedKV,
    batch: StepBatch,
    scale: float,
    num_splits: int,
    tiles: AttentionTiles,
) -> torch.Tensor:
    """``q [num_tokens, num_heads, head_dim]`` -> out like ``q``; partials and a reduction launch
    when ``num_splits > 1``."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    split = num_splits > 1
    if split:
        partial, lse = split_partials(q, num_splits)
        part_strides, lse_strides = partial.stride(), lse.stride()
    else:
        partial, lse = out, out  # lse is not read without splits
        part_strides, lse_strides = (0, *out.stride()), (0, 0, 0)
    a = kv.addressing
    grid = (batch.num_seqs, tiles.num_query_tiles, kv.num_kv_heads * num_splits)
    paged_attention_kernel[grid](
        q, *q.stride(),  # [num_tokens, num_heads, head_dim]
        partial, *part_strides,  # [num_splits, num_tokens, num_heads, head_dim]
        lse, *lse_strides,  # [num_splits, num_tokens, num_heads]
        kv.k_pages, *kv.k_pages.stride(),  # [num_pages, page_tokens, num_kv_heads, head_dim]
        kv.v_pages, *kv.v_pages.stride(),  # [num_pages, page_tokens, num_kv_heads, head_dim]
        kv.block_table, *kv.block_table.stride(),  # [num_seqs, 2, max_blocks]
        *kv.scale_args(),
        batch.cu_seqlens_q, batch.kv_lens, batch.num_cached_tokens,
        a.page_units, a.v_page_offset, scale * math.log2(math.e), num_splits,
        GROUP=num_heads // kv.num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d,
        BLOCK_TOKENS=a.block_tokens, PAGE_TOKENS=a.page_tokens, SPLIT=split,
        DOT_UPCAST=is_interpreted() and q.dtype != torch.float32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ONE_ENTRY=a.block_tokens % tiles.block_n == 0, SCALED=kv.scaled,
        FP16_MMA=kv.scaled and q.dtype != torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if split:
        launch_split_reduce(partial, lse, out)
    return out


def split_partials(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp32 partial outputs ``[num_splits, *q.shape]`` and log2-sum-exps
    ``[num_splits, num_tokens, num_heads]`` for a split launch over ``q``'s rows."""
    partial = q.new_empty((num_splits, *q.shape), dtype=torch.float32)
    return partial, q.new_empty((num_splits, *q.shape[:2]), dtype=torch.float32)


def launch_split_reduce(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """``out [num_tokens, H, D]`` = the splits' partials combined by their log2-sum-exp weights."""
    num_splits, num_tokens, num_heads, head_dim = partial.shape
    num_elements = num_tokens * num_heads * head_dim
    block_s = triton.next_power_of_2(num_splits)
    block_e = max(16, 8192 // block_s)  # a [BLOCK_S, BLOCK_E] tile of partials per program
    split_reduce_kernel[(triton.cdiv(num_elements, block_e),)](
        partial, *partial.stride(), lse, *lse.stride(), out, *out.stride(),
        num_splits, num_elements,
        HEAD_DIM=head_dim, NUM_HD=num_heads * head_dim, BLOCK_S=block_s, BLOCK_E=block_e,
        num_warps=NUM_WARPS,
    )  # fmt: skip
