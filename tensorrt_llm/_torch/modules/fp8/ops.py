"""``fp8_block_linear``: a linear layer of FP8 block-scaled weights, in one Triton launch (CUDA, or
Triton's interpreter on CPU tensors). Its reference is ``block.reference_linear``."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from tensorrt_llm._torch.modules.fp8.block import FP8, scale_shape
from tensorrt_llm._torch.modules.fp8.kernels import fp8_block_gemm_kernel


def is_interpreted() -> bool:
    return type(fp8_block_gemm_kernel).__name__ == "InterpretedFunction"


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class GemmTiles:
    block_m: int  # rows per program (tl.dot's minimum is 16)
    block_n: int  # output columns per program (divides 128: one weight-scale row)
    splits: int  # programs along K, each summing ``steps_per_split`` 128-channel steps
    steps_per_split: int
    num_warps: int = 4
    num_stages: int = 3


def gemm_tiles(m: int, n: int, k: int, device: torch.device, programs_per_sm: int = 2) -> GemmTiles:
    """Rows to cover ``m`` (16 to 64), and enough programs for the SMs: a decode batch has a few
    rows, so the weight stream is spread over the columns and, where that is not enough, over
    ``K`` too (split-K). The defaults are the best of a sweep on the H200 at the published
    widths (``n`` and ``k`` of 512 to 12288, ``m`` of 1 to 64)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if n <= 1024 else 128
    sms = num_sms(device.index or 0) if device.type == "cuda" else 1
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, 128)
    splits = min(steps, max(1, triton.cdiv(programs_per_sm * sms, tiles)))
    per_split = triton.cdiv(steps, splits)
    return GemmTiles(block_m, block_n, triton.cdiv(steps, per_split), per_split)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """``x [..., in]`` -> ``[..., out]`` in ``x``'s dtype, for ``weight [out, in]`` float8_e4m3fn
    and ``scale_inv [ceil(out / 128), ceil(in / 128)]`` fp32 (``tiles``: ``gemm_tiles``'s)."""
    n, k = weight.shape
    if weight.dtype != FP8 or tuple(scale_inv.shape) != scale_shape(n, k) or x.shape[-1] != k:
        raise ValueError(
            f"fp8_block_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
            f"scale_inv {tuple(scale_inv.shape)}: expected weight [out, in] float8_e4m3fn, "
            f"scale_inv {scale_shape(n, k)} and x [..., {k}]"
        )
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    if not m:
        return x.new_empty(*x.shape[:-1], n)
    t = tiles or gemm_tiles(m, n, k, x.device)
    if t.splits == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        target = (out, 0, *out.stride())
    else:  # fp32 partial sums, added in split order below
        partial = torch.empty((t.splits, m, n), dtype=torch.float32, device=x.device)
        target = (partial, *partial.stride())
    fp8_block_gemm_kernel[(triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.splits)](
        flat, *flat.stride(),  # [M, K]
        weight, *weight.stride(),  # [N, K]
        scale_inv, *scale_inv.stride(),  # [N / 128, K / 128]
        *target,  # [splits, M, N] or [M, N]
        m, n, k, t.steps_per_split,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, EMULATE=is_interpreted(),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if t.splits > 1:
        out = partial.sum(0).to(x.dtype)
    return out.view(*x.shape[:-1], n)
