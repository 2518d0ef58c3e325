"""The fused MoE's public op. Its torch reference, of the same signature, is
``moe.reference_experts`` (the CPU path and the test oracle).

``fused_experts`` runs the routed experts of one MoE layer in three launches and two torch ops,
none of which reads anything back to the host (so CUDA graphs capture it):

1. ``align_by_expert``: the (token, choice) slots sorted by expert, padded to ``block_m`` rows;
2. ``gate_up_kernel``: per row block, ``x[token] @ [gate; up]_e^T`` with the SwiGLU-OAI epilogue;
3. ``down_kernel``: per row block, ``act @ down_e^T`` times the slot's routing weight, written to
   the slot's own row of ``[num_slots, hidden]``;
4. the ``top_k`` rows of each token summed (a fixed order: no atomics, the same bits every run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from tensorrt_llm._torch.modules.fp8.block import FP8
from tensorrt_llm._torch.modules.fused_moe.align import align_by_expert
from tensorrt_llm._torch.modules.fused_moe.kernels import down_kernel, gate_up_kernel
from tensorrt_llm._torch.modules.gated_mlp import SwigluOai


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # slots per row block (one expert's)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int = 4
    num_stages: int = 3


PER_EXPERT = (16, 48)  # slots per expert up to which 16-row, then 32-row blocks serve; 64 past


def tile_limits(num_experts: int, top_k: int) -> list[int]:
    """The step sizes (tokens) at which ``moe_tiles`` changes its row blocks: the largest of each
    class but the last (a start-up warm-up compiles the kernels on both sides)."""
    return [limit * num_experts // top_k for limit in PER_EXPERT]


def moe_tiles(num_slots: int, num_experts: int, itemsize: int, fp8: bool) -> MoeTiles:
    """Row blocks sized to the expected slots per expert: decode batches leave most experts with a
    slot or two, so 16-row blocks (tl.dot's minimum) waste the least. FP8 steps through the
    128-channel groups of its scales."""
    per_expert = num_slots / num_experts
    block_m = 16 if per_expert <= PER_EXPERT[0] else 32 if per_expert <= PER_EXPERT[1] else 64
    block_k = 128 if fp8 else 64 if itemsize <= 2 else 32
    block_n = 128 if fp8 and per_expert >= 0.5 else 64  # FP8 past decode: fewer scale loads
    return MoeTiles(block_m, block_n, block_k, num_stages=3 if itemsize <= 2 or fp8 else 2)


def is_interpreted() -> bool:
    return type(gate_up_kernel).__name__ == "InterpretedFunction"


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    glu: SwigluOai,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """What ``reference_experts`` computes, in the kernels (any summation order); FP8 weights come
    with their block scales (``moe.StackedExperts``'s layout); ``tiles``: ``moe_tiles``'s."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    if w2.shape != (num_experts, hidden, inter) or w13.shape[2] != hidden:
        raise ValueError(
            f"fused_experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
            f"x {tuple(x.shape)}: expected [E, 2I, H] and [E, H, I]"
        )
    fp8 = w13_scale_inv is not None
    if fp8 and (w13.dtype != FP8 or w2.dtype != FP8 or w2_scale_inv is None):
        raise ValueError("fused_experts: FP8 needs float8_e4m3fn w13 and w2 and both scales")
    out = torch.empty((num_tokens, hidden), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.zero_()
    num_slots = num_tokens * top_k
    tiles = tiles or moe_tiles(num_slots, num_experts, x.element_size(), fp8)
    blocks = align_by_expert(ids, num_experts, tiles.block_m)
    act = x.new_empty((blocks.num_blocks * tiles.block_m, inter))  # [rows, I]
    # zeros: a slot of another rank's expert (id -1, expert parallelism) is never written
    per_slot = torch.zeros((num_slots, hidden), dtype=torch.float32, device=x.device)
    common = {
        "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
        "FP8": fp8, "EMULATE": is_interpreted(),
        "UPCAST": is_interpreted() and x.dtype == torch.bfloat16,
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        "num_warps": tiles.num_warps, "num_stages": tiles.num_stages,
    }  # fmt: skip
    gate_up_kernel[(blocks.num_blocks, triton.cdiv(inter, tiles.block_n))](
        x, *x.stride(),  # [T, H]
        w13, *w13.stride(),  # [E, 2I, H]
        *_scales(w13_scale_inv, w13),  # [E, 2 * cdiv(I, 128), cdiv(H, 128)]
        act, *act.stride(),  # [rows, I]
        blocks.sorted_slots, blocks.block_expert,
        num_slots, hidden, inter, glu.alpha, glu.limit,
        TOP_K=top_k, **common,
    )  # fmt: skip
    slot_weights = weights.reshape(-1).float().contiguous()  # [num_slots]
    down_kernel[(blocks.num_blocks, triton.cdiv(hidden, tiles.block_n))](
        act, *act.stride(),  # [rows, I]
        w2, *w2.stride(),  # [E, H, I]
        *_scales(w2_scale_inv, w2),  # [E, cdiv(H, 128), cdiv(I, 128)]
        per_slot, *per_slot.stride(),  # [num_slots, H]
        blocks.sorted_slots, blocks.block_expert, slot_weights,
        num_slots, hidden, inter, **common,
    )  # fmt: skip
    return torch.sum(per_slot.view(num_tokens, top_k, hidden), dim=1, out=out)


def _scales(scale_inv: torch.Tensor | None, weight: torch.Tensor) -> tuple:
    """A scale tensor and its strides for the kernels (the weight itself, unread, without FP8)."""
    return (scale_inv, *scale_inv.stride()) if scale_inv is not None else (weight, 0, 0, 0)
