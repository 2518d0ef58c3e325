"""One MiniMax-M3 MoE layer at the published width, four ways, at batch 1 to 256 (CUDA).

The layer: hidden 6144, 128 experts of 3072 (SwiGLU-OAI), top-4 by sigmoid scores with the
score-correction bias, a shared expert of 3072; bf16, random weights built on the device. Each way
runs the whole layer (router, routed experts, shared expert) on the same input:

- ``fused``: the Triton kernels (``_torch/modules/fused_moe``), replayed from a CUDA graph as the
  engine runs them (``fused, eager``: the same launches without the graph);
- ``loop``: the torch reference, one pair of GEMMs per expert hit (``moe.reference_experts``);
- ``grouped_mm``: PyTorch's own grouped GEMM, ``torch._grouped_mm``, over the slots sorted by
  expert (eager: what a user has without us);
- ``floor``: the bytes the step must read, divided by the copy bandwidth measured in the same run.
  Those bytes are the weights the routing touched: the router, the shared expert, and each expert
  that at least one token of this batch chose (counted from the routing), 3 x 6144 x 3072 x 2 bytes
  each.

The table gives microseconds per layer and each way's ratio to the floor. ``--fp8``: the experts
and the shared expert in FP8 with 128 x 128 block scales (one byte a weight, plus the scales),
fused and the torch reference (``torch._grouped_mm`` takes no block scales).

    python benchmarks/bench_moe.py [--batches 1,2,4,8,16,32,64,128,256] [--experts 128] [--iters 20]
        [--fp8]
"""

from __future__ import annotations

import argparse

import torch
from bench_common import copy_bandwidth, graphed, machine_name, time_us

from tensorrt_llm._torch.modules.fp8.block import quantize_weight
from tensorrt_llm._torch.modules.fp8.ops import fp8_block_linear
from tensorrt_llm._torch.modules.fused_moe.ops import fused_experts
from tensorrt_llm._torch.modules.gated_mlp import SwigluOai
from tensorrt_llm._torch.modules.moe import reference_experts, route

HIDDEN, INTER, SHARED, TOP_K, SCALE = 6144, 3072, 3072, 4, 2.0
GLU = SwigluOai(alpha=1.702, limit=7.0)


class Layer:
    """The MoE layer's weights, as plain tensors: ``gate [E, H]``, ``bias [E]``, ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]``, the shared expert's ``s13 [2S, H]`` and ``s2 [H, S]``; with ``fp8`` all but
    the router in FP8, their block scales in ``scales``."""

    def __init__(self, num_experts: int, dtype: torch.dtype, fp8: bool = False) -> None:
        def rand(*shape, fan_in):
            return torch.randn(*shape, device="cuda", dtype=dtype) / fan_in**0.5

        self.gate = rand(num_experts, HIDDEN, fan_in=HIDDEN)
        self.bias = torch.randn(num_experts, device="cuda") * 0.01
        self.w13 = rand(num_experts, 2 * INTER, HIDDEN, fan_in=HIDDEN)
        self.w2 = rand(num_experts, HIDDEN, INTER, fan_in=INTER)
        self.s13 = rand(2 * SHARED, HIDDEN, fan_in=HIDDEN)
        self.s2 = rand(HIDDEN, SHARED, fan_in=SHARED)
        self.num_experts = num_experts
        self.scales: dict[str, torch.Tensor] = {}
        if fp8:
            self._quantize()

    def _quantize(self) -> None:
        def stack(parts):
            return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])

        gate_up = [quantize_weight(w[:INTER]) for w in self.w13] + [
            quantize_weight(w[INTER:]) for w in self.w13
        ]
        e = self.num_experts
        self.w13 = torch.stack([torch.cat([gate_up[i][0], gate_up[e + i][0]]) for i in range(e)])
        self.scales["w13"] = torch.stack(
            [torch.cat([gate_up[i][1], gate_up[e + i][1]]) for i in range(e)]
        )
        self.w2, self.scales["w2"] = stack([quantize_weight(w) for w in self.w2])
        self.s13, self.scales["s13"] = quantize_weight(self.s13)
        self.s2, self.scales["s2"] = quantize_weight(self.s2)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x @ self.gate.T, self.bias, TOP_K)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales:
            gate, up = fp8_block_linear(x, self.s13, self.scales["s13"]).chunk(2, dim=-1)
            return fp8_block_linear(GLU(gate, up), self.s2, self.scales["s2"])
        gate, up = (x @ self.s13.T).chunk(2, dim=-1)
        return GLU(gate, up) @ self.s2.T

    def forward(self, x: torch.Tensor, experts) -> torch.Tensor:
        weights, ids = self.route(x)
        scales = (self.scales["w13"], self.scales["w2"]) if self.scales else ()
        routed = experts(x, self.w13, self.w2, weights, ids, GLU, *scales)
        return (routed * SCALE + self.shared(x).float()).to(x.dtype)

    def touched_bytes(self, x: torch.Tensor) -> int:
        """The router, the shared expert and each expert hit: weights and block scales."""
        _, ids = self.route(x)
        hit = torch.unique(ids)
        size = self.w13.element_size()
        total = self.gate.numel() * self.gate.element_size()
        total += (self.s13.numel() + self.s2.numel()) * size
        total += len(hit) * (self.w13[0].numel() + self.w2[0].numel()) * size
        for name, scale in self.scales.items():  # fp32
            per_expert = name in ("w13", "w2")
            total += (len(hit) * scale[0].numel() if per_expert else scale.numel()) * 4
        return total


def grouped_mm_experts(x, w13, w2, weights, ids, glu) -> torch.Tensor:
    """``reference_experts`` through ``torch._grouped_mm``: the slots sorted by expert, one grouped
    GEMM for gate and up, one for down, then weighted and summed per token."""
    num_experts = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).int()
    xs = x[order // ids.shape[1]]  # [num_slots, H]
    gate, up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    down = torch._grouped_mm(glu(gate, up), w2.transpose(1, 2), offs=ends)  # [num_slots, H]
    per_slot = torch.empty_like(down, dtype=torch.float32)
    per_slot[order] = down.float() * weights.reshape(-1)[order, None]
    return per_slot.view(*ids.shape, -1).sum(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip", default="", help="ways to leave out, e.g. loop")
    parser.add_argument("--fp8", action="store_true", help="FP8 block-scaled weights")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe.py needs a CUDA device")
    torch.manual_seed(0)
    layer = Layer(args.experts, torch.bfloat16, fp8=args.fp8)
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    print(
        f"machine: {machine_name('cuda')}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written)"
    )
    kind = "FP8 block scales" if args.fp8 else "bf16"
    print(
        f"MoE layer: hidden {HIDDEN}, {args.experts} experts of {INTER}, top-{TOP_K}, "
        f"shared {SHARED}, {kind}"
    )
    ways = {
        "fused": lambda x: graphed(lambda x: layer.forward(x, fused_experts), x),
        "fused, eager": lambda x: lambda: layer.forward(x, fused_experts),
        "loop": lambda x: lambda: layer.forward(x, reference_experts),
        "grouped_mm": lambda x: lambda: layer.forward(x, grouped_mm_experts),
    }
    skip = args.skip.split(",") + (["grouped_mm"] if args.fp8 else [])
    ways = {k: v for k, v in ways.items() if k not in skip}
    header = f"{'batch':>5} {'experts hit':>11} {'floor us':>9}"
    for name in ways:
        header += f" {name + ' us':>16} {'/ floor':>7}"
    print(header)
    for batch in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        want = layer.forward(x, reference_experts).float()
        floor_us = layer.touched_bytes(x) / bandwidth * 1e6
        hit = len(torch.unique(layer.route(x)[1]))
        line = f"{batch:>5} {hit:>11} {floor_us:>9.1f}"
        errors = []
        for name, make in ways.items():
            try:
                if name in ("fused", "grouped_mm"):  # the same layer, whichever way computes it
                    experts = fused_experts if name == "fused" else grouped_mm_experts
                    got = layer.forward(x, experts).float()
                    off = ((got - want).norm() / want.norm()).item()
                    if off > 2e-2:
                        raise AssertionError(f"off the reference by {off:.1e} (relative norm)")
                us = time_us(make(x), args.iters)
                line += f" {us:>16.1f} {us / floor_us:>7.2f}"
            except Exception as error:  # a way that cannot run here: said so in its cell
                line += f" {'failed':>16} {'':>7}"
                errors.append(f"  {name}: {type(error).__name__}: {str(error)[-600:]}")
        print("\n".join([line, *errors]), flush=True)


if __name__ == "__main__":
    main()
