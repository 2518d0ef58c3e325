"""RMSNorm: scale by the reciprocal root mean square of the last dimension, computed in float32.

``RMSNorm`` multiplies by ``weight`` (Llama's form; the Eagle3 drafter), ``GemmaRMSNorm`` by ``1 +
weight`` with the weight stored around 0 (Gemma's form; every norm of MiniMax-M3). Both scale in
float32 and round once, to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorrt_llm._torch.modules import fused


class RMSNorm(nn.Module):
    weight_offset = 0.0  # the scale is weight + weight_offset

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.weight_offset))  # [dim]: scale 1
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> the same shape and dtype."""
        if fused.use_fused(x, self.weight):
            return fused.rms_norm(x, self.weight, self.eps, self.weight_offset)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.weight.float() + self.weight_offset)).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    weight_offset = 1.0
