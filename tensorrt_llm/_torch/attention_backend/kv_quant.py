"""FP8 KV rows: each ``head_dim`` row of a token and head stored in ``float8_e4m3fn`` with its own
float32 scale (``KvCacheConfig(dtype="fp8")``).

A row's scale is ``amax / 448`` (``amax`` its largest magnitude, 448 e4m3's largest value),
computed as ``amax * (1 / 448)`` in fp32 and at least ``2^-126`` (a row of zeros divides by a
normal number), so its largest element is stored as 448 within fp32 rounding: the element that
dominates the row's dot products keeps its value, and nothing saturates. Rows are multiplied by
their scale's reciprocal (one IEEE division a row, rounding to nearest) and converted to e4m3
rounding to nearest even; the Triton kernels (``triton/fp8.py``) do the same products, division
and roundings, so the torch reference here and the kernels write the same bytes on any device
(torch on CUDA divides by a Python scalar as a product with its reciprocal: hence products).
``benchmarks/bench_fp8_kv_accuracy.py`` compares this with a power-of-two scale (which changes
nothing but the range: e4m3's relative precision is the same at every exponent) and with none.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to fp32 where it multiplies
MIN_SCALE = 2.0**-126  # fp32's smallest normal number


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` -> the float32 scale of each row ``[...]``: ``amax / 448``."""
    return (x.float().abs().amax(dim=-1) * INV_FP8_MAX).clamp(min=MIN_SCALE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (``[..., D]`` float8_e4m3fn, ``[...]`` float32 scales)."""
    scales = row_scales(x)
    return (x.float() * torch.reciprocal(scales)[..., None]).to(FP8_DTYPE), scales


def dequantize_rows(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows [..., D]`` of FP8 and their scales ``[...]`` -> float32 ``[..., D]``."""
    return rows.float() * scales[..., None]
