"""Triton kernels of MiniMax sparse attention (MSA); launchers and the public op are in
``triton_msa.py``, the rule in ``msa.py``.

MSA selects key blocks per query token and per KV group: index head ``g`` picks the blocks that
query heads ``g * GROUP .. g * GROUP + GROUP - 1`` (the heads sharing KV head ``g``) attend. Block
scores, selections and the query tiles' unions of selected blocks all carry that group axis.

Two units of keys, never mixed up:

- a **page** (kernel page) holds ``TOKENS_PER_PAGE`` consecutive positions of one sequence; key
  ``j`` of batch row ``seq`` is at ``pages[table[seq, j // TOKENS_PER_PAGE], j % TOKENS_PER_PAGE]``;
- a **key block** is MSA's unit of selection, ``BLOCK_SIZE`` consecutive positions (128 in M3).

Every key is addressed on its own through the block table, so the two sizes are independent. Page
tensors are strided views into a pool (``[num_pages, tokens_per_page, heads, head_dim]``, page
stride = slot size); page ids are widened to int64 before they meet that stride.

A **query tile** is ``TILE_TOKENS`` consecutive step tokens of one sequence; tile ``tile`` of
sequence ``seq`` has the batch-wide id ``seq + cu_seqlens_q[seq] // TILE_TOKENS + tile`` (distinct
for distinct tiles, and below ``num_seqs + num_tokens // TILE_TOKENS + 1``).

In an FP8 cache (``SCALED``) the rows go to the dot products as they are (converted to fp16 with
the query, exact: ``attention_backend/triton/fp8.py`` says why fp16) and their scales
multiply score columns (K, index-K) and probability columns (V) instead
(``attention_backend/triton/attention_kernel.py`` says why that is the same).

``tl.dot`` needs every dimension >= 16: tiles are padded to powers of two >= 16 and masked. fp32
operands are multiplied with ``DOT_PRECISION="ieee"`` (no TF32); accumulation is fp32 throughout.
Address arithmetic is written out in each kernel rather than in nested ``@triton.jit`` helpers:
under the interpreter every nested call costs milliseconds.
"""

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tensorrt_llm._torch.attention_backend.triton.fp8 import scale_offsets, value_weights


@triton.jit
def _msa_block_scores_kernel(
    iq_ptr, stride_iqt, stride_iqg, stride_iqd,  # index_q [num_tokens, NUM_GROUPS, INDEX_DIM]
    ik_ptr, stride_ikp, stride_ikt, stride_ikd,  # index-K [num_pages, TOKENS_PER_PAGE, INDEX_DIM]
    iks_ptr, SCALE_UNITS: tl.constexpr, stride_ss, stride_sp, stride_sr,  # SCALED: index-K's ScalePages
    table_ptr, stride_table_seq, stride_table_page,  # lane-0 block table [num_seqs, max_pages]
    cu_seqlens_q_ptr, pos_ptr,  # [num_seqs + 1], [num_tokens]
    out_ptr, stride_ot, stride_og, stride_ob,  # [num_tokens, NUM_GROUPS, num_key_blocks] fp32
    NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
    INDEX_DIM: tl.constexpr, INDEX_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKENS_PER_PAGE: tl.constexpr, TILE_TOKENS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_seqs, cdiv(max_q_len, TILE_TOKENS), num_key_blocks)``: rows ``r = m *
    GROUPS_PAD + g`` are index head ``g`` of the tile's token ``t = m``; each gets the max over
    the keys ``j <= pos[t]`` of key block ``kblock`` of the raw dot product ``q[t, g] . k[j]``
    (-inf where no key is visible). The block's index-K is read once for every group. A program
    whose tile sees no key of its block returns at once: the output is -inf there already."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kblock = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
    tile_begin = q_begin + tile * TILE_TOKENS
    block_start = kblock * BLOCK_SIZE
    # positions rise by one along a sequence's step tokens: the tile's last token sees the most
    last_tok = tl.minimum(tile_begin + TILE_TOKENS, q_end) - 1
    last_pos = tl.load(pos_ptr + last_tok, mask=tile_begin < q_end, other=-1)
    if block_start <= last_pos:
        offs_r = tl.arange(0, ROWS)
        m = offs_r // GROUPS_PAD
        g = offs_r % GROUPS_PAD
        toks = tile_begin + m  # [ROWS] token indices
        row_ok = (m < TILE_TOKENS) & (g < NUM_GROUPS) & (toks < q_end)
        toks = toks.to(tl.int64)
        pos = tl.load(pos_ptr + toks, mask=row_ok, other=-1)  # [ROWS]
        offs_d = tl.arange(0, INDEX_DIM_PAD)
        d_ok = offs_d < INDEX_DIM
        iq_rows = iq_ptr + toks * stride_iqt + g * stride_iqg  # [ROWS]
        iq = tl.load(
            iq_rows[:, None] + offs_d[None, :] * stride_iqd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [ROWS, INDEX_DIM_PAD]
        if DOT_FP32:
            iq = iq.to(tl.float32)
        elif SCALED:
            iq = iq.to(tl.float16)
        best = tl.full([ROWS], float("-inf"), tl.float32)
        for n0 in range(0, BLOCK_SIZE, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            keys = block_start + offs_n  # [BLOCK_N] key positions
            key_ok = (offs_n < BLOCK_SIZE) & (keys <= last_pos)
            page = tl.load(
                table_ptr + seq * stride_table_seq + (keys // TOKENS_PER_PAGE) * stride_table_page,
                mask=key_ok,
                other=0,
            )
            key_off = page.to(tl.int64) * stride_ikp + (keys % TOKENS_PER_PAGE) * stride_ikt
            ik = tl.load(
                ik_ptr + key_off[None, :] + offs_d[:, None] * stride_ikd,
                mask=d_ok[:, None] & key_ok[None, :],
                other=0.0,
            )  # [INDEX_DIM_PAD, BLOCK_N]
            ik = ik.to(tl.float32) if DOT_FP32 else ik.to(iq.dtype)
            score = tl.dot(iq, ik, input_precision=DOT_PRECISION)  # [ROWS, BLOCK_N]
            if SCALED:
                rows = scale_offsets(
                    page, keys % TOKENS_PER_PAGE, 0, SCALE_UNITS, stride_ss, stride_sp, stride_sr
                )
                score *= tl.load(iks_ptr + rows, mask=key_ok, other=0.0)[None, :]
            visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
            best = tl.maximum(best, tl.max(tl.where(visible, score, float("-inf")), axis=1))
        out_off = toks * stride_ot + g * stride_og + kblock * stride_ob
        tl.store(out_ptr + out_off, best, mask=row_ok)


@triton.jit
def _msa_select_kernel(
    score_ptr, stride_st, stride_sg, stride_sb,  # block scores [num_tokens, G, num_key_blocks]
    sel_ptr, stride_selt, stride_selg, stride_selb,  # [num_tokens, G, num_key_blocks] int8 (0/1)
    union_ptr, stride_ut, stride_ug, stride_ub,  # [num_tile_ids, G, num_key_blocks] int32
    count_ptr, stride_ct, stride_cg,  # [num_tile_ids, G] int32: entries of union_ptr's row used
    cu_seqlens_q_ptr, pos_ptr, num_key_blocks,  # [num_seqs + 1], [num_tokens]
    BLOCK_SIZE: tl.constexpr, TOPK: tl.constexpr, NUM_LOCAL: tl.constexpr,
    TILE_TOKENS: tl.constexpr, SUB_TOKENS: tl.constexpr, BLOCK_B: tl.constexpr,
    NO_BLOCK: tl.constexpr,  # the key of a -inf score at the last block: below every real one
):  # fmt: skip
    """Grid ``(num_seqs, cdiv(max_q_len, TILE_TOKENS), G)``. Per token of the query tile, for KV
    group ``group``: its forced blocks ``q_block - i`` (``i < NUM_LOCAL``, clamped at 0), then the
    best of the other visible blocks by score up to ``TOPK`` blocks in all (equal scores go to the
    earlier block; only finite scores). Then the tile's union of the group's blocks, ascending."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    group = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
    tile_begin = q_begin + tile * TILE_TOKENS
    if tile_begin < q_end:
        blocks = tl.arange(0, BLOCK_B)
        in_range = (blocks < num_key_blocks)[None, :]  # [1, BLOCK_B]
        union = tl.zeros([BLOCK_B], tl.int32)
        for sub in range(0, TILE_TOKENS, SUB_TOKENS):
            offs_t = sub + tl.arange(0, SUB_TOKENS)
            toks = tile_begin + offs_t  # [SUB_TOKENS]
            tok_ok = (offs_t < TILE_TOKENS) & (toks < q_end)
            toks = toks.to(tl.int64)
            q_block = (tl.load(pos_ptr + toks, mask=tok_ok, other=0) // BLOCK_SIZE)[:, None]
            visible = (blocks[None, :] <= q_block) & in_range & tok_ok[:, None]
            # the forced blocks score +inf, so they are the first picks of the top-TOPK and the
            # other picks are the best TOPK - NUM_LOCAL of the rest (fewer forced blocks only
            # near the sequence's start, where no other block is visible)
            forced = visible & (blocks[None, :] > q_block - NUM_LOCAL)  # [SUB_TOKENS, BLOCK_B]
            score_rows = score_ptr + toks * stride_st + group * stride_sg  # [SUB_TOKENS]
            score = tl.load(
                score_rows[:, None] + blocks[None, :] * stride_sb,
                mask=visible & ~forced,
                other=float("-inf"),
            )  # [SUB_TOKENS, BLOCK_B]
            # one max per pick: a score's order-preserving int32 above its block's rank (the
            # earlier block ranks higher), so the max is the best score's earliest block
            bits = score.to(tl.int32, bitcast=True)
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
            key = (ordered << 32) | (BLOCK_B - 1 - blocks)[None, :]  # [SUB_TOKENS, BLOCK_B]
            chosen = forced.to(tl.int32)
            for _ in range(TOPK - NUM_LOCAL):
                top = tl.max(key, axis=1)[:, None]  # [SUB_TOKENS, 1]
                pick = key == top
                chosen = tl.where(pick & (top > NO_BLOCK), 1, chosen)
                key = tl.where(pick, NO_BLOCK, key)
            sel_rows = sel_ptr + toks * stride_selt + group * stride_selg  # [SUB_TOKENS]
            tl.store(
                sel_rows[:, None] + blocks[None, :] * stride_selb,
                chosen.to(tl.int8),
                mask=tok_ok[:, None] & in_range,
            )
            union = tl.maximum(union, tl.max(chosen, axis=0))
        tile_id = seq + q_begin // TILE_TOKENS + tile
        slot = tl.cumsum(union, axis=0) - 1  # where each chosen block goes in the compact list
        row = union_ptr + tile_id * stride_ut + group * stride_ug
        tl.store(row + slot * stride_ub, blocks, mask=union > 0)
        tl.store(count_ptr + tile_id * stride_ct + group * stride_cg, tl.sum(union, axis=0))


@triton.jit
def _online_softmax_step(
    q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, scale,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """One key tile of online softmax: ``q [ROWS, D]``, ``k [D, BLOCK_N]``, ``v [BLOCK_N, D]``,
    ``visible [ROWS, BLOCK_N]``, the rows' scales ``[BLOCK_N]`` (1 but in an FP8 cache); returns
    the running max ``m_i``, the running sum ``l_i`` of ``exp(score - m_i)`` (both ``[ROWS]``) and
    the accumulator ``acc [ROWS, D]``, updated."""
    if DOT_FP32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        if SCALED:  # FP8 rows: the MMAs in fp16 (loop-invariant for q: hoisted)
            q = q.to(tl.float16)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale * k_scale[None, :]  # [ROWS, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf) in a masked row
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p, factor = value_weights(p, v_scale, SCALED and not DOT_FP32)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv * factor
    return m_new, l_i, acc


@triton.jit
def _load_kv(
    k_ptr, v_ptr, stride_kvp, stride_kvt, stride_kvh, stride_kvd,
    table_k_ptr, table_v_ptr, stride_table_seq, stride_table_page,
    ks_ptr, vs_ptr, SCALE_UNITS: tl.constexpr, stride_ss, stride_sp, stride_sr,
    seq, kv_head, keys, key_ok, offs_d, d_ok, TOKENS_PER_PAGE: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """K ``[HEAD_DIM_PAD, BLOCK_N]`` and V ``[BLOCK_N, HEAD_DIM_PAD]`` of key positions ``keys``
    through the block table (0 where masked), and their rows' scales ``[BLOCK_N]`` (1 unless
    ``SCALED``)."""
    page_idx = seq * stride_table_seq + (keys // TOKENS_PER_PAGE) * stride_table_page
    in_page = (keys % TOKENS_PER_PAGE) * stride_kvt + kv_head * stride_kvh
    k_page = tl.load(table_k_ptr + page_idx, mask=key_ok, other=0).to(tl.int64)
    k_off = (k_page * stride_kvp + in_page)[None, :] + offs_d[:, None] * stride_kvd
    k = tl.load(k_ptr + k_off, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
    v_page = tl.load(table_v_ptr + page_idx, mask=key_ok, other=0).to(tl.int64)
    v_off = (v_page * stride_kvp + in_page)[:, None] + offs_d[None, :] * stride_kvd
    v = tl.load(v_ptr + v_off, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    if SCALED:
        row = keys % TOKENS_PER_PAGE
        k_rows = scale_offsets(k_page, row, kv_head, SCALE_UNITS, stride_ss, stride_sp, stride_sr)
        v_rows = scale_offsets(v_page, row, kv_head, SCALE_UNITS, stride_ss, stride_sp, stride_sr)
        k_scale = tl.load(ks_ptr + k_rows, mask=key_ok, other=0.0)
        v_scale = tl.load(vs_ptr + v_rows, mask=key_ok, other=0.0)
    else:
        k_scale = tl.full(keys.shape, 1.0, tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _store_split(
    part_ptr, stride_ps, stride_pt, stride_ph, stride_pd,
    lse_ptr, stride_ls, stride_lt, stride_lh,
    split, toks, heads, offs_d, row_ok, qo_mask, acc, m_i, l_i,
):  # fmt: skip
    """A split's normalised partial output and its log-sum-exp in log2 units (what
    ``split_reduce_kernel`` combines); -inf for a row that saw no key."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    p_off = split * stride_ps + toks[:, None] * stride_pt + heads[:, None] * stride_ph
    tl.store(part_ptr + p_off + offs_d[None, :] * stride_pd, acc / l_safe[:, None], mask=qo_mask)
    lse = tl.where(l_i > 0, (m_i + tl.log(l_safe)) * 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + split * stride_ls + toks * stride_lt + heads * stride_lh, lse, mask=row_ok)


@triton.jit
def _store_out(out_rows, stride_od, offs_d, qo_mask, acc, l_i):
    """The normalised output rows at ``out_rows`` (a row pointer each), in their dtype (0 for a
    row that saw no key)."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_rows + offs_d[None, :] * stride_od, out.to(out_rows.dtype.element_ty), mask=qo_mask
    )


@triton.jit
def _msa_sparse_attention_kernel(
    q_ptr, stride_qt, stride_qh, stride_qd,  # [num_tokens, num_heads, HEAD_DIM]
    out_ptr, stride_ot, stride_oh, stride_od,  # [num_tokens, num_heads, HEAD_DIM]
    k_ptr, v_ptr, stride_kvp, stride_kvt, stride_kvh, stride_kvd,  # K, V pages, one layout
    table_k_ptr, table_v_ptr, stride_table_seq, stride_table_page,  # lanes 0 and 1 of the table
    ks_ptr, vs_ptr, SCALE_UNITS: tl.constexpr, stride_ss, stride_sp, stride_sr,  # SCALED: K's and V's ScalePages
    sel_ptr, stride_selt, stride_selg, stride_selb,  # [num_tokens, Hkv, num_key_blocks] int8 0/1
    # the tiles' blocks per group [num_tile_ids, Hkv, num_key_blocks], counts [num_tile_ids, Hkv]
    union_ptr, stride_ut, stride_ug, stride_ub, count_ptr, stride_ct, stride_cg,
    cu_seqlens_q_ptr, pos_ptr,  # [num_seqs + 1], [num_tokens]
    # SPLIT only: [num_splits, num_tokens, num_heads, HEAD_DIM] fp32, [num_splits, num_tokens,
    # num_heads] fp32 (log2 units), as split_reduce_kernel (attention_kernel.py) combines them
    part_ptr, stride_ps, stride_pt, stride_ph, stride_pd,
    lse_ptr, stride_ls, stride_lt, stride_lh,
    scale, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKENS_PER_PAGE: tl.constexpr, TILE_TOKENS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_seqs, cdiv(max_q_len, TILE_TOKENS), num_kv_heads * num_splits)``: rows ``r = m *
    GROUP_PAD + g`` are query head ``kv_head * GROUP + g`` of the tile's token ``m``. The tile
    visits the union of the key blocks its tokens selected for KV group ``kv_head`` once (split
    ``s`` its ``s``-th share of the union's entries); row ``r`` sees the keys ``j <= pos`` of the
    blocks its own token selected for that group (online softmax in fp32). With ``SPLIT`` each
    split writes its normalised partial output and log-sum-exp instead of the output."""
    seq, tile = tl.program_id(0), tl.program_id(1)
    kv_head, split = tl.program_id(2) // num_splits, tl.program_id(2) % num_splits
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
    tile_begin = q_begin + tile * TILE_TOKENS
    if tile_begin < q_end:
        offs_r = tl.arange(0, ROWS)
        m, g = offs_r // GROUP_PAD, offs_r % GROUP_PAD
        toks = (tile_begin + m).to(tl.int64)  # [ROWS]
        row_ok = (m < TILE_TOKENS) & (g < GROUP) & (toks < q_end)
        heads = kv_head * GROUP + g
        pos = tl.load(pos_ptr + toks, mask=row_ok, other=-1)  # [ROWS]
        last_pos = tl.max(pos, axis=0)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        qo_mask = row_ok[:, None] & d_ok[None, :]  # [ROWS, HEAD_DIM_PAD]
        q_off = toks[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptr + q_off, mask=qo_mask, other=0.0)  # [ROWS, HEAD_DIM_PAD]
        m_i, l_i = tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
        tile_id = seq + q_begin // TILE_TOKENS + tile
        count = tl.load(count_ptr + tile_id * stride_ct + kv_head * stride_cg)
        union_row = union_ptr + tile_id * stride_ut + kv_head * stride_ug
        sel_rows = sel_ptr + toks * stride_selt + kv_head * stride_selg  # [ROWS]
        share = tl.cdiv(count, num_splits)
        for u in range(split * share, tl.minimum(count, split * share + share)):
            kblock = tl.load(union_row + u * stride_ub)
            sel = tl.load(sel_rows + kblock * stride_selb, mask=row_ok, other=0)
            for n0 in range(0, BLOCK_SIZE, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                keys = kblock * BLOCK_SIZE + offs_n  # [BLOCK_N] key positions
                key_ok = (offs_n < BLOCK_SIZE) & (keys <= last_pos)
                k, v, k_scale, v_scale = _load_kv(
                    k_ptr, v_ptr, stride_kvp, stride_kvt, stride_kvh, stride_kvd,
                    table_k_ptr, table_v_ptr, stride_table_seq, stride_table_page,
                    ks_ptr, vs_ptr, SCALE_UNITS, stride_ss, stride_sp, stride_sr,
                    seq, kv_head, keys, key_ok, offs_d, d_ok, TOKENS_PER_PAGE, SCALED,
                )  # fmt: skip
                # keys of the blocks the row's token selected for the group, at positions <= its
                visible = (sel != 0)[:, None] & key_ok[None, :] & (keys[None, :] <= pos[:, None])
                m_i, l_i, acc = _online_softmax_step(
                    q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, scale,
                    DOT_FP32, DOT_PRECISION, SCALED,
                )  # fmt: skip
        if SPLIT:
            _store_split(
                part_ptr, stride_ps, stride_pt, stride_ph, stride_pd,
                lse_ptr, stride_ls, stride_lt, stride_lh,
                split, toks, heads, offs_d, row_ok, qo_mask, acc, m_i, l_i,
            )  # fmt: skip
        else:
            o_off = toks[:, None] * stride_ot + heads[:, None] * stride_oh
            _store_out(out_ptr + o_off, stride_od, offs_d, qo_mask, acc, l_i)


# Under TRITON_INTERPRET=1 the kernels are not JITFunctions. Triton's interpreter gets tl.dot of
# 16-bit floats wrong (seen with 3.9), so the launchers then multiply in fp32.
INTERPRETED = not isinstance(_msa_sparse_attention_kernel, JITFunction)
