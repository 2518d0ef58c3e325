"""The grouped GEMMs of the fused MoE. Each program takes one row block of the slots sorted by
expert (``align.py``: every row one (token, choice) slot of the block's expert, padding rows
masked) and one tile of output columns, and loops over the reduction dimension.

With ``FP8`` the expert weights are float8 with 128 x 128 block scales (``fp8/block.py``): the
reduction steps are the 128-channel groups, each group of the activations is quantized on the fly
(``quantize_group``), and each step's product takes its two scales. ``BLOCK_N`` then divides 128,
so one weight-scale row serves a tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tensorrt_llm._torch.modules.fp8.kernels import fp8_dot, quantize_group


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:  # the interpreter has no bf16 matmul
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _step(a, w_tile, acc, s_row, k_step, stride_sk, FP8: tl.constexpr, EMULATE: tl.constexpr,
          UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """``acc += a @ w_tile`` for one reduction step (``a`` quantized first under ``FP8``)."""
    # (if/else, not an early return: the compiler would also build the code after the return)
    if FP8:
        q, a_scale = quantize_group(a.to(tl.float32), EMULATE)
        w_scale = tl.load(s_row + k_step * stride_sk)
        acc = acc + fp8_dot(q, w_tile, EMULATE) * (a_scale[:, None] * w_scale)
    else:
        acc = _dot(a, w_tile, acc, UPCAST, PRECISION)
    return acc


@triton.jit
def gate_up_kernel(
    x_ptr, stride_xt, stride_xh,  # [num_tokens, hidden]
    w_ptr, stride_we, stride_wn, stride_wh,  # [num_experts, 2 * inter, hidden]: gate rows, up rows
    s_ptr, stride_se, stride_sn, stride_sk,  # FP8: [E, 2 * cdiv(inter, 128), cdiv(hidden, 128)]
    out_ptr, stride_om, stride_on,  # [num_blocks * BLOCK_M, inter]: rows in sorted order
    sorted_slots_ptr, block_expert_ptr,  # [num_blocks * BLOCK_M], [num_blocks]
    num_slots, hidden, inter, alpha, limit,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, EMULATE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``out[row, n] = swiglu_oai(x[token] . gate_e[n], x[token] . up_e[n])`` for the block's
    expert ``e``, the token of each row's slot and the columns ``n`` of this program's tile."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    row_ok = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_gate = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    # FP8: the gate rows' scales, then the up rows' (cdiv(inter, 128) rows later)
    s_gate = s_ptr + expert * stride_se + (tl.program_id(1) * BLOCK_N // 128) * stride_sn
    s_up = s_gate + tl.cdiv(inter, 128) * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(
            x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xh,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b_mask = k_ok[:, None] & col_ok[None, :]
        bg = tl.load(w_gate + ks[:, None] * stride_wh, mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        bu = tl.load(w_up + ks[:, None] * stride_wh, mask=b_mask, other=0.0)
        if FP8:  # the activations quantized once for both products
            q, a_scale = quantize_group(a.to(tl.float32), EMULATE)
            step = k0 // BLOCK_K
            gate += fp8_dot(q, bg, EMULATE) * (
                a_scale[:, None] * tl.load(s_gate + step * stride_sk)
            )
            up += fp8_dot(q, bu, EMULATE) * (a_scale[:, None] * tl.load(s_up + step * stride_sk))
        else:
            gate = _dot(a, bg, gate, UPCAST, PRECISION)
            up = _dot(a, bu, up, UPCAST, PRECISION)
    # SwiGLU-OAI in fp32
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def down_kernel(
    a_ptr, stride_am, stride_ak,  # [num_blocks * BLOCK_M, inter]: gate_up_kernel's output
    w_ptr, stride_we, stride_wn, stride_wk,  # [num_experts, hidden, inter]
    s_ptr, stride_se, stride_sn, stride_sk,  # FP8: [E, cdiv(hidden, 128), cdiv(inter, 128)]
    out_ptr, stride_os, stride_on,  # [num_slots, hidden] fp32
    sorted_slots_ptr, block_expert_ptr, slot_weights_ptr,  # [rows], [num_blocks], [num_slots] fp32
    num_slots, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, EMULATE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``out[slot, n] = weight[slot] * (a[row] . down_e[n])``: each slot's row written once."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    row_ok = slots < num_slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    s_row = s_ptr + expert * stride_se + (tl.program_id(1) * BLOCK_N // 128) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(w + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _step(a, b, acc, s_row, k0 // BLOCK_K, stride_sk, FP8, EMULATE, UPCAST, PRECISION)
    weight = tl.load(slot_weights_ptr + slots, mask=row_ok, other=0.0)
    out = out_ptr + slots[:, None].to(tl.int64) * stride_os + cols[None, :] * stride_on
    tl.store(out, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])
