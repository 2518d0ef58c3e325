"""Triton kernels of paged attention over a mixed batch, and the split-K (flash-decoding) reduction.

A program owns one (sequence, query tile, KV head, split). Its rows are (query token, query head)
pairs of the KV head's GQA group, token-major, so a decode step of 1 + 3 tokens at 4 heads per KV
head fills one 16-row tile::

    row r of tile t   ->  token  (t * BLOCK_M + r) // GROUP        position  num_cached + token
                          head   kv_head * GROUP + (t * BLOCK_M + r) % GROUP

    keys of split s   ->  [s * chunk, (s + 1) * chunk)  clipped to the causal end of the tile,
                          chunk = ceil(kv_len / num_splits) rounded up to BLOCK_N

Scores are kept in log2 units (``scale_log2 = scale * log2(e)``) with an online softmax in fp32.
Without splits a program writes the normalised output in q's dtype; with splits it writes its
partial output (fp32) and its log2-sum-exp, and ``split_reduce_kernel`` combines them.

FP8 pages (``SCALED``): the rows go to the MMA as they are, converted to fp16 with the query
(``FP16_MMA``; ``fp8.py`` says why: both exact), and their scales are applied in registers where
they cost a vector, not a tile: key ``j``'s scale multiplies score column ``j`` (``q . (s k) = s
(q . k)``) and value ``j``'s multiplies probability column ``j`` before the PV product (``p (s v) =
(p s) v``, ``fp8.value_weights``): the same products, rounded in another order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tensorrt_llm._torch.attention_backend.triton.fp8 import scale_offsets, value_weights
from tensorrt_llm._torch.attention_backend.triton.kv_write_kernel import page_row


@triton.jit
def _mma(a, b, DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``DOT_UPCAST`` (interpreter, 16-bit operands): the
    interpreter's ``tl.dot`` multiplies bf16 bit patterns, so operands go to fp32 first (exact)."""
    if DOT_UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _tile_pages(
    table_ptr, stride_ts, stride_tl, stride_tb, seq, lane, start, pos, key_mask,
    page_units, v_page_offset,
    BLOCK_TOKENS: tl.constexpr, PAGE_TOKENS: tl.constexpr, ONE_ENTRY: tl.constexpr,
):  # fmt: skip
    """``page_row`` for a key tile starting at ``start``. ``ONE_ENTRY``: the tile lies inside one
    table entry's span (``BLOCK_N`` divides ``block_tokens``, tiles start on a multiple of
    ``BLOCK_N``), so one scalar load of the entry replaces a gather per key."""
    if ONE_ENTRY:
        entry = tl.load(
            table_ptr + seq * stride_ts + lane * stride_tl + (start // BLOCK_TOKENS) * stride_tb
        )
        page = entry.to(tl.int64) * page_units + lane * v_page_offset
        page += (pos % BLOCK_TOKENS) // PAGE_TOKENS
        row = pos % PAGE_TOKENS
    else:
        page, row = page_row(
            table_ptr, stride_ts, stride_tl, stride_tb, seq, lane, pos, key_mask,
            page_units, v_page_offset, BLOCK_TOKENS, PAGE_TOKENS,
        )  # fmt: skip
    return page, row


@triton.jit
def _attend(
    q, q_pos, lo, hi, seq, kv_head,  # q [BLOCK_M, BLOCK_D], q_pos [BLOCK_M]; keys [lo, hi)
    k_pages_ptr, stride_kp, stride_kr, stride_kh, stride_kd,  # [num_pages, page_tokens, Hkv, D]
    v_pages_ptr, stride_vp, stride_vr, stride_vh, stride_vd,  # [num_pages, page_tokens, Hkv, D]
    table_ptr, stride_ts, stride_tl, stride_tb,  # [num_seqs, 2, max_blocks]
    ks_ptr, vs_ptr, SCALE_UNITS: tl.constexpr, stride_ss, stride_sp, stride_sr,  # SCALED: K's, V's ScalePages
    page_units, v_page_offset, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, PAGE_TOKENS: tl.constexpr,
    DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr, ONE_ENTRY: tl.constexpr,
    SCALED: tl.constexpr, FP16_MMA: tl.constexpr,
):  # fmt: skip
    """Online softmax of the tile's rows over keys [lo, hi): (acc [BLOCK_M, BLOCK_D], m, l)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dim = tl.arange(0, BLOCK_D)
    dim_mask = dim < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_mask = pos < hi
        page, row = _tile_pages(
            table_ptr, stride_ts, stride_tl, stride_tb, seq, 0, start, pos, key_mask,
            page_units, v_page_offset, BLOCK_TOKENS, PAGE_TOKENS, ONE_ENTRY,
        )  # fmt: skip
        k_ptrs = k_pages_ptr + page[None, :] * stride_kp + row[None, :] * stride_kr
        k_ptrs += kv_head * stride_kh + dim[:, None] * stride_kd
        k_t = tl.load(k_ptrs, mask=dim_mask[:, None] & key_mask[None, :], other=0.0)  # [D, N]
        scores = _mma(q, k_t.to(q.dtype), DOT_UPCAST, PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if SCALED:
            offsets = scale_offsets(
                page, row, kv_head, SCALE_UNITS, stride_ss, stride_sp, stride_sr
            )
            scores *= tl.load(ks_ptr + offsets, mask=key_mask, other=0.0)[None, :]
        visible = (pos[None, :] <= q_pos[:, None]) & key_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        page, row = _tile_pages(
            table_ptr, stride_ts, stride_tl, stride_tb, seq, 1, start, pos, key_mask,
            page_units, v_page_offset, BLOCK_TOKENS, PAGE_TOKENS, ONE_ENTRY,
        )  # fmt: skip
        v_ptrs = v_pages_ptr + page[:, None] * stride_vp + row[:, None] * stride_vr
        v_ptrs += kv_head * stride_vh + dim[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=key_mask[:, None] & dim_mask[None, :], other=0.0)  # [N, D]
        factor = 1.0
        if SCALED:
            offsets = scale_offsets(
                page, row, kv_head, SCALE_UNITS, stride_ss, stride_sp, stride_sr
            )
            v_scale = tl.load(vs_ptr + offsets, mask=key_mask, other=0.0)
            p, factor = value_weights(p, v_scale, FP16_MMA)
        pv = _mma(p.to(q.dtype), v.to(q.dtype), DOT_UPCAST, PRECISION)
        acc = acc * alpha[:, None] + pv * factor
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def paged_attention_kernel(
    q_ptr, stride_qt, stride_qh, stride_qd,  # [num_tokens, num_heads, head_dim]
    # [num_tokens, num_heads, head_dim] like q; with SPLIT [num_splits, ...] fp32
    out_ptr, stride_os, stride_ot, stride_oh, stride_od,
    lse_ptr, stride_ls, stride_lt, stride_lh,  # SPLIT only: [num_splits, num_tokens, num_heads]
    k_pages_ptr, stride_kp, stride_kr, stride_kh, stride_kd,
    v_pages_ptr, stride_vp, stride_vr, stride_vh, stride_vd,
    table_ptr, stride_ts, stride_tl, stride_tb,
    ks_ptr, vs_ptr, SCALE_UNITS: tl.constexpr, stride_ss, stride_sp, stride_sr,
    cu_q_ptr, kv_lens_ptr, cached_ptr,  # [num_seqs + 1], [num_seqs], [num_seqs] int32
    page_units, v_page_offset, scale_log2, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, PAGE_TOKENS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ONE_ENTRY: tl.constexpr, SCALED: tl.constexpr, FP16_MMA: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_seqs, query tiles, num_kv_heads * num_splits)``; see the module docstring."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(cu_q_ptr + seq)
    num_rows = (tl.load(cu_q_ptr + seq + 1) - q_start) * GROUP
    if tile * BLOCK_M < num_rows:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < num_rows
        tok = q_start + rows // GROUP  # [BLOCK_M] index into the step's tokens
        head = kv_head * GROUP + rows % GROUP
        cached = tl.load(cached_ptr + seq)
        q_pos = cached + rows // GROUP
        last_pos = cached + (tl.minimum(tile * BLOCK_M + BLOCK_M, num_rows) - 1) // GROUP
        kv_len = tl.load(kv_lens_ptr + seq)
        chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, last_pos + 1)  # causal: no key past the tile's last query
        dim = tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (dim < HEAD_DIM)[None, :]
        q_ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptrs + dim[None, :] * stride_qd, mask=mask, other=0.0)
        if FP16_MMA:
            q = q.to(tl.float16)
        acc, m_i, l_i = _attend(
            q, q_pos, lo, hi, seq, kv_head,
            k_pages_ptr, stride_kp, stride_kr, stride_kh, stride_kd,
            v_pages_ptr, stride_vp, stride_vr, stride_vh, stride_vd,
            table_ptr, stride_ts, stride_tl, stride_tb,
            ks_ptr, vs_ptr, SCALE_UNITS, stride_ss, stride_sp, stride_sr,
            page_units, v_page_offset, scale_log2,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_TOKENS, PAGE_TOKENS, DOT_UPCAST, PRECISION,
            ONE_ENTRY, SCALED, FP16_MMA,
        )  # fmt: skip
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split: output 0, weight 0
        out_ptrs = (
            out_ptr + split * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh
        )
        out = acc / l_safe[:, None]
        tl.store(out_ptrs + dim[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=mask)
        if SPLIT:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            lse_ptrs = lse_ptr + split * stride_ls + tok * stride_lt + head * stride_lh
            tl.store(lse_ptrs, lse, mask=row_mask)


@triton.jit
def split_reduce_kernel(
    part_ptr, stride_ps, stride_pt, stride_ph, stride_pd,  # [num_splits, num_tokens, H, D] fp32
    lse_ptr, stride_ls, stride_lt, stride_lh,  # [num_splits, num_tokens, H] fp32, log2 units
    out_ptr, stride_ot, stride_oh, stride_od,  # [num_tokens, H, D] like q
    num_splits, num_elements,  # num_elements = num_tokens * H * D
    HEAD_DIM: tl.constexpr, NUM_HD: tl.constexpr,  # NUM_HD = H * D
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Program i combines output elements [i * BLOCK_E, (i + 1) * BLOCK_E) of the flattened
    ``[num_tokens, H, D]`` over the splits: out = sum_s w_s o_s / sum_s w_s,
    w_s = 2^(lse_s - max_s lse_s)."""
    elem = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    tok = elem // NUM_HD
    head = (elem % NUM_HD) // HEAD_DIM
    dim = elem % HEAD_DIM
    split = tl.arange(0, BLOCK_S)
    mask = (split < num_splits)[:, None] & (elem < num_elements)[None, :]  # [BLOCK_S, BLOCK_E]
    lse_ptrs = lse_ptr + split[:, None] * stride_ls + (tok * stride_lt + head * stride_lh)[None, :]
    lse = tl.load(lse_ptrs, mask=mask, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)[None, :])  # 0 where empty
    offset = tok * stride_pt + head * stride_ph + dim * stride_pd
    parts = tl.load(part_ptr + split[:, None] * stride_ps + offset[None, :], mask=mask, other=0.0)
    total = tl.sum(weight, 0)  # > 0 for every real element: some split holds its query's key
    out = tl.sum(parts * weight, 0) / tl.where(total == 0.0, 1.0, total)
    out_ptrs = out_ptr + tok * stride_ot + head * stride_oh + dim * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=elem < num_elements)
