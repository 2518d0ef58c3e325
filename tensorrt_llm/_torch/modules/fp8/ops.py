"""``fp8_block_linear``: a linear layer of FP8 block-scaled weights, in one Triton launch (CUDA, or
Triton's interpreter on CPU tensors). Its reference is ``block.reference_linear``."""

from __future__ import annotations

import functools

import torch
import triton

from tensorrt_llm._torch.modules.fp8.block import FP8, scale_shape
from tensorrt_llm._torch.modules.fp8.kernels import fp8_block_gemm_kernel


def is_interpreted() -> bool:
    return type(fp8_block_gemm_kernel).__name__ == "InterpretedFunction"


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemm_tiles(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: rows to cover ``m`` (16 to 64), and 64 columns unless that leaves
    the SMs idle (decode: a few rows, so the weight stream must be spread over many programs)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    sms = num_sms(device.index or 0) if device.type == "cuda" else 1
    block_n = 64 if triton.cdiv(m, block_m) * triton.cdiv(n, 64) >= 2 * sms else 32
    return block_m, block_n


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor
) -> torch.Tensor:
    """``x [..., in]`` -> ``[..., out]`` in ``x``'s dtype, for ``weight [out, in]`` float8_e4m3fn
    and ``scale_inv [ceil(out / 128), ceil(in / 128)]`` fp32."""
    n, k = weight.shape
    if weight.dtype != FP8 or tuple(scale_inv.shape) != scale_shape(n, k) or x.shape[-1] != k:
        raise ValueError(
            f"fp8_block_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
            f"scale_inv {tuple(scale_inv.shape)}: expected weight [out, in] float8_e4m3fn, "
            f"scale_inv {scale_shape(n, k)} and x [..., {k}]"
        )
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n = gemm_tiles(m, n, x.device)
        fp8_block_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            flat, *flat.stride(),  # [M, K]
            weight, *weight.stride(),  # [N, K]
            scale_inv, *scale_inv.stride(),  # [N / 128, K / 128]
            out, *out.stride(),  # [M, N]
            m, n, k,
            BLOCK_M=block_m, BLOCK_N=block_n, EMULATE=is_interpreted(),
            num_warps=4, num_stages=3,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
