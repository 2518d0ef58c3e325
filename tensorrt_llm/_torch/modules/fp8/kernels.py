"""Triton pieces of FP8 block scales: the on-the-fly activation quantization and the block-scaled
GEMM. ``EMULATE`` (under Triton's interpreter, which has no float8 matmul and whose float8 cast
truncates) rounds to e4m3 in exact fp32 arithmetic (``round_to_e4m3``: to nearest, ties to even,
as torch's cast and the GPU's) and keeps the values in fp32 for the dot."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(v):
    """``v`` (fp32, |v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in fp32
    arithmetic that is exact everywhere (the exponent and the step are read and built from bits)."""
    a = tl.abs(v)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(a)), a normal
    exponent = tl.maximum(exponent, -6)  # e4m3's subnormals share the step of 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    x = a / step  # exact: a power-of-two step
    f = tl.floor(x)
    odd = f - 2.0 * tl.floor(f * 0.5)
    r = tl.where(x - f > 0.5, f + 1.0, tl.where(x - f < 0.5, f, f + odd))
    q = tl.minimum(r * step, 448.0)
    return tl.where(v < 0, -q, q)


@triton.jit
def quantize_group(a, EMULATE: tl.constexpr):
    """``a [ROWS, 128]`` (fp32, one 128-channel group per row) -> the quantized values (float8, or
    fp32 holding float8 values when ``EMULATE``) and each row's scale ``[ROWS]``, as
    ``block.quantize_activation`` computes them: one IEEE division per row (``div_rn``: Triton's
    ``/`` is approximate on GPUs), a multiply per value, and the cast's round to nearest even."""
    amax = tl.maximum(tl.max(tl.abs(a), 1), 1e-12)
    scaled = a * tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)[:, None]
    if EMULATE:  # noqa: SIM108 (a constexpr branch)
        q = round_to_e4m3(scaled)
    else:
        q = scaled.to(tl.float8e4nv)
    return q, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))


@triton.jit
def fp8_dot(q, b, EMULATE: tl.constexpr):
    """``q [M, K] @ b [K, N]`` of float8 values, accumulated in fp32."""
    if EMULATE:  # noqa: SIM108 (a constexpr branch)
        out = tl.dot(q, b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(q, b)
    return out


@triton.jit
def fp8_block_gemm_kernel(
    x_ptr, stride_xm, stride_xk,  # [M, K] bf16/fp16/fp32
    w_ptr, stride_wn, stride_wk,  # [N, K] float8_e4m3fn
    s_ptr, stride_sn, stride_sk,  # [cdiv(N, 128), cdiv(K, 128)] fp32
    out_ptr, stride_os, stride_om, stride_on,  # [SPLITS, M, N] (fp32 partial sums) or [M, N]
    M, N, K, steps_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """``out = quant(x) @ w^T`` with both scales applied per 128-channel step. ``BLOCK_N``
    divides 128, so a tile's columns share one weight-scale row. Program ``(m, n, split)`` sums
    the steps ``[split * steps_per_split, (split + 1) * steps_per_split)`` into ``out[split]``
    (split-K: a decode batch of a few rows has too few output tiles to keep the SMs streaming the
    weight; the splits' sums are added afterwards, in a fixed order)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, col_ok = rows < M, cols < N
    scale_row = s_ptr + (tl.program_id(1) * BLOCK_N // 128) * stride_sn
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, 128))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first, last):
        ks = kb * 128 + tl.arange(0, 128)
        k_ok = ks < K
        a = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, 128]
        q, a_scale = quantize_group(a, EMULATE)
        b = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # [128, BLOCK_N]
        w_scale = tl.load(scale_row + kb * stride_sk)
        acc += fp8_dot(q, b, EMULATE) * (a_scale[:, None] * w_scale)
    out = out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_om
    out += cols[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
