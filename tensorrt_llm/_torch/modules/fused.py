"""One-launch Triton forms of the shared layers' elementwise math, for inference on CUDA.

``rms_norm`` and ``partial_rope`` compute what ``RMSNorm.forward`` and ``apply_partial_rope``
compute (the torch forms are the reference, the CPU path and the training path), in one kernel
each instead of the half-dozen (norm) or two dozen (rotary) elementwise launches of the torch
form; a decode step of a small batch is made of such launches. The layers call them through
``use_fused(x)``: a CUDA tensor, Triton importable, no autograd.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: the torch forms only
    triton = None


def use_fused(*tensors: torch.Tensor) -> bool:
    """Whether the fused forms apply: CUDA tensors, Triton present, nothing to differentiate."""
    if triton is None or not all(t.is_cuda for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, w_ptr, out_ptr, num_rows, dim, stride_x, stride_out, eps, w_offset,
        ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        x = x * tl.rsqrt(tl.sum(x * x, 1) / dim + eps)[:, None]
        w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32) + w_offset
        y = (x * w[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=mask)

    @triton.jit
    def _partial_rope_kernel(
        x_ptr, stride_xt, stride_xh,  # [num_tokens, num_heads, HEAD_DIM], last dim contiguous
        out_ptr, stride_ot, stride_oh,  # like x
        pos_ptr, inv_freq_ptr, num_heads,  # [num_tokens], [HALF] fp32
        HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One program per token: every head's first ``2 * HALF`` dims rotated, the rest copied."""
        t = tl.program_id(0)
        i = tl.arange(0, BLOCK_HALF)
        angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(
            inv_freq_ptr + i, mask=i < HALF, other=0.0
        )  # the fp32 product the torch form takes the cosine of
        # cos and sin in fp64 (a precise libm call; fp32 tl.cos is an approximation that drifts at
        # angles of thousands of radians), rounded back to fp32
        angle = angle.to(tl.float64)
        cos, sin = tl.cos(angle).to(tl.float32)[None, :], tl.sin(angle).to(tl.float32)[None, :]
        h = tl.arange(0, BLOCK_H)[:, None]
        src = x_ptr + t * stride_xt + h * stride_xh
        dst = out_ptr + t * stride_ot + h * stride_oh
        mask = (h < num_heads) & (i < HALF)[None, :]
        x1 = tl.load(src + i[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        tl.store(dst + i[None, :], (x1 * cos - x2 * sin).to(dtype), mask=mask)
        tl.store(dst + HALF + i[None, :], (x2 * cos + x1 * sin).to(dtype), mask=mask)
        d = tl.arange(0, BLOCK_D)[None, :]
        rest = (h < num_heads) & (d >= 2 * HALF) & (d < HEAD_DIM)
        tl.store(dst + d, tl.load(src + d, mask=rest, other=0.0), mask=rest)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> torch.Tensor:
    """``x [..., dim]`` scaled by the reciprocal RMS of its last dim (fp32), times ``weight +
    weight_offset``."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block_d = triton.next_power_of_2(dim)
    rows = max(1, min(64, 4096 // block_d))
    if x2.shape[0]:
        _rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, weight, out, x2.shape[0], dim, x2.stride(0), out.stride(0), eps, weight_offset,
            ROWS=rows, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out.view(x.shape)


@functools.cache
def inv_freq(device: torch.device, rotary_dim: int, theta: float) -> torch.Tensor:
    """``rope_inv_freq`` on ``device``, made once."""
    with torch.inference_mode():
        return rope_inv_freq(rotary_dim, theta, device)


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """RoPE's ``1 / theta ** (2i / rotary_dim)``, ``i < rotary_dim / 2``, in fp32, computed as
    transformers computes it (the same bits): the torch form's and the kernel's frequencies."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
    return 1.0 / (theta ** (exponents / rotary_dim))


def partial_rope(
    x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float
) -> torch.Tensor:
    """Neox RoPE on the first ``rotary_dim`` dims of each head: ``x [num_tokens, H, D]``,
    ``positions [num_tokens]``."""
    if x.dim() != 3 or positions.shape != x.shape[:1] or rotary_dim % 2 or rotary_dim > x.shape[2]:
        raise ValueError(
            f"partial_rope: x {tuple(x.shape)} must be [num_tokens, heads, head_dim] with "
            f"positions [num_tokens] (got {tuple(positions.shape)}) and an even rotary_dim <= "
            f"head_dim (got {rotary_dim})"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens:
        half = rotary_dim // 2
        _partial_rope_kernel[(num_tokens,)](
            x, x.stride(0), x.stride(1), out, out.stride(0), out.stride(1),
            positions, inv_freq(x.device, rotary_dim, theta), num_heads,
            HEAD_DIM=head_dim, HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=4,
        )  # fmt: skip
    return out
