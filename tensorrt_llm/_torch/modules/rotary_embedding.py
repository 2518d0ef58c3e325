"""Rotary position embedding (RoPE), Neox style, on a leading part of each head."""

from __future__ import annotations

import torch

from tensorrt_llm._torch.modules import fused


def apply_partial_rope(
    x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float
) -> torch.Tensor:
    """Neox-style RoPE on the first ``rotary_dim`` dims of each head. ``x [..., T, H, D]``,
    ``positions [..., T]``."""
    if x.dim() == 3 and fused.use_fused(x, positions):  # the paged path's [num_tokens, H, D]
        return fused.partial_rope(x, positions, rotary_dim, theta)
    half = rotary_dim // 2
    inv_freq = fused.rope_inv_freq(rotary_dim, theta, x.device)  # [half]
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, half]
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]  # [..., T, 1, half]
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1)
