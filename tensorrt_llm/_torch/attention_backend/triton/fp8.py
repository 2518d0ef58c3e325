"""FP8 KV rows in Triton: the quantization of ``kv_quant.py``, bit for bit, and the scale address.

A row's scale is ``amax * (1 / 448)`` (at least ``2^-126``); its rows are multiplied by its
reciprocal, an IEEE division (``div_rn``: Triton's plain fp32 ``/`` is an approximation on CUDA),
rounded to the e4m3 grid to nearest even *in fp32* and only then converted, so the conversion
itself never rounds (the interpreter's fp32 -> e4m3 conversion drops the carry when rounding
crosses a power of two: 127.1 became 64). Reading a row back is ``fp8 -> fp32`` times its scale.

The MMA of FP8 rows runs in fp16 (``FP16_MMA``): on Hopper e4m3 converts to fp16 in one
instruction per pair, to bf16 only through fp32, and a decode kernel that converts every K and V
element is bound by those conversions, not by its reads (``bench_decode_kernels.py`` times it). A
bf16 query converts exactly to fp16 inside fp16's range. Value scales multiply the probabilities
(``value_weights``), normalised so fp16 keeps them in its normal range.

A page's scales sit at ``scale_ptr + (page // units) * stride_slot + (page % units) * stride_page
+ row * stride_row + head`` (``ScalePages`` in ``interface.py``): ``units`` is 1 when a page is a
slot, ``slot_units`` for the draft sub-page view.
"""

from __future__ import annotations

import triton
import triton.language as tl

INV_FP8_MAX: tl.constexpr = tl.constexpr(1.0 / 448.0)  # kv_quant.INV_FP8_MAX
MIN_SCALE: tl.constexpr = tl.constexpr(2.0**-126)  # kv_quant.MIN_SCALE


@triton.jit
def _pow2(exponent):
    """``2^exponent`` in fp32 from its bits (``exponent`` int32 in [-126, 127])."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(x):
    """``x`` (fp32, ``|x| < 464``) rounded to the nearest e4m3 value, ties to even, still fp32."""
    bits = x.to(tl.int32, bitcast=True)
    # the grid's spacing: 2^(e - 3) for normal e4m3 (e >= -6), 2^-9 below
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    y = tl.abs(x) * _pow2(-exponent)  # exact: y < 16
    low = tl.floor(y)
    frac = y - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    magnitude = (low + up.to(tl.float32)) * _pow2(exponent)
    return tl.where(bits < 0, -magnitude, magnitude)  # the sign bit kept, -0.0 included


@triton.jit
def quantize_rows(x, AXIS: tl.constexpr):
    """Rows of ``x`` along ``AXIS`` -> (values on the e4m3 grid in fp32, their fp32 scales with
    ``AXIS`` reduced). Store the values with ``.to(<fp8 pointer>.dtype.element_ty)``."""
    x = x.to(tl.float32)
    scales = tl.maximum(tl.max(tl.abs(x), AXIS) * INV_FP8_MAX, MIN_SCALE)
    inverse = tl.math.div_rn(tl.full(scales.shape, 1.0, tl.float32), scales)
    return round_to_e4m3(x * tl.expand_dims(inverse, AXIS)), scales


@triton.jit
def scale_offsets(page, row, head, UNITS: tl.constexpr, stride_slot, stride_page, stride_row):
    """Element offsets of the scales of rows ``row`` of pages ``page`` for KV head ``head``
    (``UNITS`` a compile-time constant: a page that is a slot costs no integer division)."""
    if UNITS == 1:
        offsets = page * stride_slot + row * stride_row + head
    else:
        offsets = (page // UNITS) * stride_slot + (page % UNITS) * stride_page
        offsets += row * stride_row + head
    return offsets


@triton.jit
def value_weights(p, v_scale, FP16_MMA: tl.constexpr):
    """The probabilities ``p [M, N]`` weighted by the value rows' scales ``v_scale [N]`` for the
    PV product, and the factor its result takes: ``p v_scale`` and 1, or with ``FP16_MMA``
    ``p v_scale / top * 2^15`` and ``top * 2^-15`` (``top`` the tile's largest scale: every weight
    <= 2^15 fits fp16, and only a key below 2^-29 of ``top`` leaves fp16's normal range)."""
    if FP16_MMA:
        top = tl.max(v_scale, 0)
        top = tl.where(top > 0.0, top, 1.0)  # a tile of masked keys (scale 0)
        weighted = p * ((v_scale / top) * 32768.0)[None, :]
        factor = top * (1.0 / 32768.0)
    else:
        weighted = p * v_scale[None, :]
        factor = 1.0
    return weighted, factor
