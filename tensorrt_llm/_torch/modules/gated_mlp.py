"""Gated MLPs: ``down(act(gate(x), up(x)))``, their columns split over the TP ranks.

Two activations: SiLU (``silu(gate) * up``; the Eagle3 drafter) and MiniMax-M3's SwiGLU-OAI
(``SwigluOai``), which clamps both halves before gating.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.modules.linear import ColumnParallelLinear, RowParallelLinear


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True)
class SwigluOai:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1.0) * (gate * torch.sigmoid(gate * self.alpha))


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        mapping: Mapping | None = None,
        glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_glu,
    ) -> None:
        super().__init__()
        mapping = mapping or Mapping()
        what = "intermediate_size"
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, mapping, what)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, mapping, what)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, mapping, what)
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden_size]`` -> ``[..., hidden_size]`` (the full sum on every rank)."""
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))
