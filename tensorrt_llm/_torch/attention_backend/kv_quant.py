"""FP8 KV rows: each ``head_dim`` row of a token and head stored in ``float8_e4m3fn`` with its own
power-of-two float32 scale (``KvCacheConfig(dtype="fp8")``).

The scale of a row with largest magnitude ``amax = m * 2^e`` (``1 <= m < 2``) is ``2^(e - 8)`` when
``m <= 1.75`` and ``2^(e - 7)`` otherwise, so the row's largest element lands in ``[224, 448]``, the
top of the format's range (448 = 1.75 * 2^8), and nothing saturates. Because the scale is a power of
two, dividing by it and multiplying back are exact, and a dequantized element (4 significant bits
times a power of two) is exact in bfloat16: the torch reference here and the Triton kernels
(``triton/fp8.py``) compute bit for bit the same rows and scales, and a kernel's bfloat16 MMA
operands lose nothing. The scale's exponent is found from amax's bits, never a logarithm.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MANTISSA_175 = 0x600000  # the fp32 mantissa field of 1.75


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` -> the power-of-two float32 scale of each row ``[...]`` (module docstring)."""
    amax = x.float().abs().amax(dim=-1).contiguous()
    bits = amax.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = exponent - 8 + ((bits & 0x7FFFFF) > _MANTISSA_175).to(torch.int32)
    return ((exponent.clamp(-126, 127) + 127) << 23).view(torch.float32)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (``[..., D]`` float8_e4m3fn, ``[...]`` float32 scales)."""
    scales = row_scales(x)
    return (x.float() / scales[..., None]).to(FP8_DTYPE), scales


def dequantize_rows(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows [..., D]`` of FP8 and their scales ``[...]`` -> float32 ``[..., D]``."""
    return rows.float() * scales[..., None]
