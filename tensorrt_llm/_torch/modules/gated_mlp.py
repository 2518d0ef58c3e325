"""The SiLU-gated MLP: ``down(silu(gate(x)) * up(x))``, its columns split over the TP ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.modules.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, mapping: Mapping | None = None
    ) -> None:
        super().__init__()
        mapping = mapping or Mapping()
        what = "intermediate_size"
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, mapping, what)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, mapping, what)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, mapping, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden_size]`` -> ``[..., hidden_size]`` (the full sum on every rank)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
