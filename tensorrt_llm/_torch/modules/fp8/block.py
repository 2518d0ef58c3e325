"""FP8 block scales in torch: the format, weight (de)quantization, and the reference of the GEMM.

A quantized weight ``[out, in]`` is ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` of
``[ceil(out / 128), ceil(in / 128)]``: element ``(o, i)`` is ``weight[o, i] * scale_inv[o // 128,
i // 128]`` (the blocks at the right and bottom edges may be partial). Activations are quantized
on the fly, per token per 128-channel group: ``q = x * (448 / amax(|group|))`` cast to float8,
``scale = amax / 448`` (a multiply per value: what a GPU kernel does cheaply and exactly).

``reference_linear`` is the Triton GEMM's (``ops.fp8_block_linear``) reference and oracle.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8 = torch.float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero group keeps a positive scale (its values quantize to 0)


def scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    return -(-out_features // BLOCK), -(-in_features // BLOCK)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """``w [out, in]`` zero-padded to whole blocks, as ``[out_blocks, 128, in_blocks, 128]``."""
    out_blocks, in_blocks = scale_shape(*w.shape)
    padded = w.new_zeros(out_blocks * BLOCK, in_blocks * BLOCK)
    padded[: w.shape[0], : w.shape[1]] = w
    return padded.view(out_blocks, BLOCK, in_blocks, BLOCK)


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``[out_blocks, in_blocks]`` -> one scale per element of a ``shape`` weight."""
    full = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return full[: shape[0], : shape[1]]


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> ``(weight fp8 [out, in], weight_scale_inv fp32 [out_blocks, in_blocks])``,
    each block scaled so that its largest magnitude is 448."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight: expected a 2-D weight, got {tuple(w.shape)}")
    blocks = _blocks(w.float())
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (w.float() / expand_scales(scale_inv, w.shape)).to(FP8)
    return q, scale_inv


def dequantize_weight(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The inverse of ``quantize_weight`` (exact in fp32): ``weight * scale_inv`` per block."""
    want = scale_shape(*weight.shape)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"weight_scale_inv {tuple(scale_inv.shape)} does not fit a weight "
            f"{tuple(weight.shape)}: expected {want} (blocks of {BLOCK})"
        )
    return (weight.float() * expand_scales(scale_inv.float(), weight.shape)).to(dtype)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(fp8 [M, K], scales fp32 [M, ceil(K / 128)])``, per token per group."""
    m, k = x.shape
    groups = -(-k // BLOCK)
    padded = x.new_zeros(m, groups * BLOCK, dtype=torch.float32)
    padded[:, :k] = x
    amax = padded.view(m, groups, BLOCK).abs().amax(-1).clamp(min=MIN_AMAX)
    fp8_max = torch.full_like(amax, FP8_MAX)  # tensor / tensor: ``448 / t`` is 448 * (1 / t)
    inv = (fp8_max / amax).repeat_interleave(BLOCK, 1)[:, :k]
    return (x.float() * inv).to(FP8), amax / fp8_max


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor
) -> torch.Tensor:
    """``x [..., in] @ dequant(weight)^T`` with ``x`` quantized per token per group first, in fp32,
    returned in ``x``'s dtype: what the kernel computes, up to the order of its sums."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_activation(flat)
    a = q.float() * scale.repeat_interleave(BLOCK, 1)[:, : flat.shape[1]]
    out = a @ dequantize_weight(weight, scale_inv).T
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
