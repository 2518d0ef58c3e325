"""Triton kernels that address paged KV: the shared page/row helper and the KV write.

Page tensors are ``[num_pages, page_tokens, num_kv_heads, head_dim]`` views (often strided views
into a pool: the page stride is the slot size); every stride is an argument. ``addressing.py``
gives the formula ``page_row`` implements. FP8 pages are written by ``kv_write_fp8_kernel``: one
KV head per program, each row quantized with its scale (``fp8.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tensorrt_llm._torch.attention_backend.triton.fp8 import quantize_rows, scale_offsets


@triton.jit
def page_row(
    table_ptr,  # [num_seqs, 2, max_blocks] int32
    stride_ts,
    stride_tl,
    stride_tb,
    seq,
    lane,
    pos,
    mask,
    page_units,
    v_page_offset,
    BLOCK_TOKENS: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """(page, row in page) of KV positions ``pos`` of sequences ``seq`` on ``lane`` (0 K, 1 V)."""
    entry = tl.load(
        table_ptr + seq * stride_ts + lane * stride_tl + (pos // BLOCK_TOKENS) * stride_tb,
        mask=mask,
        other=0,
    )
    page = entry.to(tl.int64) * page_units + lane * v_page_offset
    page += (pos % BLOCK_TOKENS) // PAGE_TOKENS
    return page, pos % PAGE_TOKENS


@triton.jit
def _copy_tokens(
    src_ptr,  # [num_tokens, num_kv_heads, head_dim]
    stride_st,
    stride_sh,
    stride_sd,
    dst_ptr,  # [num_pages, page_tokens, num_kv_heads, head_dim]
    stride_dp,
    stride_dr,
    stride_dh,
    stride_dd,
    tok,  # [BLOCK_T]
    page,  # [BLOCK_T] int64
    row,  # [BLOCK_T]
    head,  # [BLOCK_HD]
    dim,  # [BLOCK_HD]
    mask,  # [BLOCK_T, BLOCK_HD]
):
    src = src_ptr + tok[:, None] * stride_st + head[None, :] * stride_sh + dim[None, :] * stride_sd
    values = tl.load(src, mask=mask)
    dst = dst_ptr + page[:, None] * stride_dp + row[:, None] * stride_dr
    dst += head[None, :] * stride_dh + dim[None, :] * stride_dd
    tl.store(dst, values.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kv_write_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_pages_ptr,  # [num_pages, page_tokens, num_kv_heads, head_dim]
    v_pages_ptr,  # [num_pages, page_tokens, num_kv_heads, head_dim]
    table_ptr,  # [num_seqs, 2, max_blocks] int32
    pos_ptr,  # [num_tokens] KV position of each token
    seq_ptr,  # [num_tokens] sequence (table row) of each token
    num_tokens,
    page_units,
    v_page_offset,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kpp,
    stride_kpr,
    stride_kph,
    stride_kpd,
    stride_vpp,
    stride_vpr,
    stride_vph,
    stride_vpd,
    stride_ts,
    stride_tl,
    stride_tb,
    HEAD_DIM: tl.constexpr,
    NUM_HD: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    WRITE_V: tl.constexpr,
):
    """Program i stores tokens [i * BLOCK_T, (i + 1) * BLOCK_T) of K and (``WRITE_V``) of V, all
    heads: a tile ``[BLOCK_T, num_kv_heads * head_dim]`` (column c is head c // HEAD_DIM, dim
    c % HEAD_DIM)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < num_tokens
    col = tl.arange(0, BLOCK_HD)
    head = col // HEAD_DIM
    dim = col % HEAD_DIM
    mask = tok_mask[:, None] & (col < NUM_HD)[None, :]
    pos = tl.load(pos_ptr + tok, mask=tok_mask, other=0)
    seq = tl.load(seq_ptr + tok, mask=tok_mask, other=0)
    # the row in a page is the same for K and V; the page differs by lane
    k_page, row = page_row(
        table_ptr, stride_ts, stride_tl, stride_tb, seq, 0, pos, tok_mask,
        page_units, v_page_offset, BLOCK_TOKENS, PAGE_TOKENS,
    )  # fmt: skip
    _copy_tokens(
        k_ptr, stride_kt, stride_kh, stride_kd,
        k_pages_ptr, stride_kpp, stride_kpr, stride_kph, stride_kpd,
        tok, k_page, row, head, dim, mask,
    )  # fmt: skip
    if WRITE_V:
        v_page, row = page_row(
            table_ptr, stride_ts, stride_tl, stride_tb, seq, 1, pos, tok_mask,
            page_units, v_page_offset, BLOCK_TOKENS, PAGE_TOKENS,
        )  # fmt: skip
        _copy_tokens(
            v_ptr, stride_vt, stride_vh, stride_vd,
            v_pages_ptr, stride_vpp, stride_vpr, stride_vph, stride_vpd,
            tok, v_page, row, head, dim, mask,
        )  # fmt: skip


@triton.jit
def _quantize_tokens(
    src_ptr, stride_st, stride_sh, stride_sd,  # [num_tokens, num_kv_heads, head_dim]
    dst_ptr, stride_dp, stride_dr, stride_dh, stride_dd,  # FP8 [num_pages, page_tokens, H, D]
    scale_ptr, SCALE_UNITS: tl.constexpr, stride_ss, stride_sp, stride_sr,  # float32 ScalePages
    tok, page, row, head, dim, tok_mask, dim_mask,
):  # fmt: skip
    mask = tok_mask[:, None] & dim_mask[None, :]
    src = src_ptr + tok[:, None] * stride_st + head * stride_sh + dim[None, :] * stride_sd
    rows, scales = quantize_rows(tl.load(src, mask=mask, other=0.0), 1)
    dst = dst_ptr + page[:, None] * stride_dp + row[:, None] * stride_dr + head * stride_dh
    tl.store(dst + dim[None, :] * stride_dd, rows.to(dst_ptr.dtype.element_ty), mask=mask)
    offsets = scale_offsets(page, row, head, SCALE_UNITS, stride_ss, stride_sp, stride_sr)
    tl.store(scale_ptr + offsets, scales, mask=tok_mask)


@triton.jit
def kv_write_fp8_kernel(
    k_ptr, stride_kt, stride_kh, stride_kd,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr, stride_vt, stride_vh, stride_vd,
    k_pages_ptr, stride_kpp, stride_kpr, stride_kph, stride_kpd,  # FP8 pages
    v_pages_ptr, stride_vpp, stride_vpr, stride_vph, stride_vpd,
    ks_ptr, vs_ptr, SCALE_UNITS: tl.constexpr, stride_ss, stride_sp, stride_sr,  # their ScalePages
    table_ptr, stride_ts, stride_tl, stride_tb,  # [num_seqs, 2, max_blocks] int32
    pos_ptr, seq_ptr, num_tokens, page_units, v_page_offset,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, PAGE_TOKENS: tl.constexpr, WRITE_V: tl.constexpr,
):  # fmt: skip
    """Program (i, h) stores tokens [i * BLOCK_T, (i + 1) * BLOCK_T) of KV head h, K and
    (``WRITE_V``) V, each ``head_dim`` row as FP8 with its scale (``fp8.py``)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    tok_mask = tok < num_tokens
    dim = tl.arange(0, BLOCK_D)
    dim_mask = dim < HEAD_DIM
    pos = tl.load(pos_ptr + tok, mask=tok_mask, other=0)
    seq = tl.load(seq_ptr + tok, mask=tok_mask, other=0)
    k_page, row = page_row(
        table_ptr, stride_ts, stride_tl, stride_tb, seq, 0, pos, tok_mask,
        page_units, v_page_offset, BLOCK_TOKENS, PAGE_TOKENS,
    )  # fmt: skip
    _quantize_tokens(
        k_ptr, stride_kt, stride_kh, stride_kd,
        k_pages_ptr, stride_kpp, stride_kpr, stride_kph, stride_kpd,
        ks_ptr, SCALE_UNITS, stride_ss, stride_sp, stride_sr,
        tok, k_page, row, head, dim, tok_mask, dim_mask,
    )  # fmt: skip
    if WRITE_V:
        v_page, row = page_row(
            table_ptr, stride_ts, stride_tl, stride_tb, seq, 1, pos, tok_mask,
            page_units, v_page_offset, BLOCK_TOKENS, PAGE_TOKENS,
        )  # fmt: skip
        _quantize_tokens(
            v_ptr, stride_vt, stride_vh, stride_vd,
            v_pages_ptr, stride_vpp, stride_vpr, stride_vph, stride_vpd,
            vs_ptr, SCALE_UNITS, stride_ss, stride_sp, stride_sr,
            tok, v_page, row, head, dim, tok_mask, dim_mask,
        )  # fmt: skip
