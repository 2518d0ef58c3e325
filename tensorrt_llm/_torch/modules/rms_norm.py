"""RMSNorm: scale by the reciprocal root mean square of the last dimension, computed in float32."""

from __future__ import annotations

import torch
from torch import nn

from tensorrt_llm._torch.modules import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [dim]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> the same shape and dtype."""
        if fused.use_fused(x, self.weight):
            return fused.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)
