"""MiniMax-M3's mixture of experts: sigmoid routing with a score-correction bias, SwiGLU-OAI experts,
and a shared expert.

Per token ``x`` (``E = num_local_experts``, ``k = num_experts_per_tok``)::

    s       = sigmoid(gate(x))                       fp32 [E]
    chosen  = top-k of s + e_score_correction_bias   (the bias steers the choice only)
    w_e     = s_e / sum over chosen of s             e in chosen
    out     = routed_scaling_factor * sum_e w_e * expert_e(x)  +  shared_experts(x)

Each expert is a SwiGLU-OAI MLP of ``intermediate_size``; their weights are stacked, ``w13 [E,
2 * I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``. Under tensor parallelism every rank
holds every expert's share of ``I`` (and of the shared expert), and the partial sums are
all-reduced; the router is replicated.

The experts run fused on CUDA (``fused_moe``: two grouped GEMMs in Triton over the slots sorted by
expert, no host sync, so CUDA graphs capture them) and as the torch reference elsewhere
(``reference_experts``: a loop over the experts some token chose, in transformers' order of
summation; also the training path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.distributed.communicator import all_reduce
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.distributed.moe_all_to_all import all_to_all_experts, all_to_all_fixed
from tensorrt_llm._torch.modules.fp8.block import FP8, reference_linear, scale_shape
from tensorrt_llm._torch.modules.fused import use_fused
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP, SwigluOai


def reference_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    glu: SwigluOai,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``, ``weights,
    ids [T, k]`` -> ``sum_k weights * expert_ids(x)``, fp32 ``[T, H]``. Visits the experts some
    token chose, in expert order (transformers' order of summation); an id of -1 is another
    rank's expert (expert parallelism), skipped. FP8 weights come with their
    block scales, ``w13_scale_inv [E, 2 * cdiv(I, 128), cdiv(H, 128)]`` (the gate rows' blocks,
    then the up rows') and ``w2_scale_inv [E, cdiv(H, 128), cdiv(I, 128)]``; each GEMM then
    quantizes its input per token per 128-channel group (``fp8.block.reference_linear``)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        token, choice = torch.where(ids == e)
        if w13_scale_inv is None:
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            part = F.linear(glu(gate, up), w2[e])
        else:
            split = scale_shape(inter, 1)[0]
            gate = reference_linear(x[token], w13[e, :inter], w13_scale_inv[e, :split])
            up = reference_linear(x[token], w13[e, inter:], w13_scale_inv[e, split:])
            part = reference_linear(glu(gate, up), w2[e], w2_scale_inv[e])
        out.index_add_(0, token, (part * weights[token, choice, None]).float())
    return out


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int  # num_local_experts
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each routed expert's
    shared_intermediate_size: int
    routed_scaling_factor: float


def route(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> the chosen experts' weights ``[T, k]`` (fp32, summing to 1) and
    ids ``[T, k]``."""
    scores = torch.sigmoid(logits.float())
    _, ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1, sorted=False)
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


class StackedExperts(nn.Module):
    """This rank's routed experts (``Mapping.local_experts``), each its slice of the
    intermediate columns (``Mapping.moe_shard``): SwiGLU-OAI MLPs, stacked."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        mapping: Mapping,
        glu: SwigluOai,
    ) -> None:
        super().__init__()
        local = mapping.local_experts(num_experts)
        self.num_global_experts, self.num_experts = num_experts, len(local)
        self.expert_start = local.start
        self.local_intermediate = mapping.moe_shard(intermediate_size)
        self.tp_size, self.tp_rank = mapping.moe_tp_size, mapping.moe_tp_rank
        self.ep_size = mapping.moe_ep_size
        # EP under attention DP: tokens travel (``moe_all_to_all``); under TP attention every
        # rank has every token and one all-reduce sums the ranks' shares
        self.all_to_all = mapping.moe_all_to_all
        self.reduce = not self.all_to_all and mapping.moe_ep_size * mapping.moe_tp_size > 1
        inter, num_local = self.local_intermediate, self.num_experts
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * inter, hidden_size))  # [E, 2I, H]
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, inter))  # [E, H, I]
        self.glu = glu
        self.w13_scale_inv = self.w2_scale_inv = None

    fp8_block: str | None = None  # as ``linear.Fp8BlockLinear``'s

    def to_fp8_block(self) -> None:
        """``w13`` and ``w2`` become float8_e4m3fn with block scales: ``w13_scale_inv [E, 2 *
        cdiv(I, 128), cdiv(H, 128)]`` (the gate rows' blocks, then the up rows'), ``w2_scale_inv
        [E, cdiv(H, 128), cdiv(I, 128)]``; the loader fills them."""
        e, two_inter, hidden = self.w13.shape
        inter = two_inter // 2
        device = self.w13.device
        gate_blocks, hidden_blocks = scale_shape(inter, hidden)
        for name, shape in (
            ("w13_scale_inv", (e, 2 * gate_blocks, hidden_blocks)),
            ("w2_scale_inv", (e, hidden_blocks, gate_blocks)),
        ):
            delattr(self, name)
            self.register_buffer(name, torch.empty(shape, dtype=torch.float32, device=device))
        for name in ("w13", "w2"):
            param = getattr(self, name)
            setattr(
                self, name, nn.Parameter(torch.empty_like(param, dtype=FP8), requires_grad=False)
            )
        self.fp8_block = "store"

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        capacity: int | None = None,
    ) -> torch.Tensor:
        """``x [T, H]``, ``weights, ids [T, k]`` (global expert ids) -> ``sum_e w_e *
        expert_e(x)``, fp32 ``[T, H]``, summed over the ranks. ``capacity``: where tokens
        travel between ranks, the exchange's fixed rows per rank (None: sized by the counts)."""
        if self.all_to_all:
            args = (x, weights, ids, self.num_experts, self.ep_size, self.local)
            if capacity is not None:
                return all_to_all_fixed(*args, capacity)
            return all_to_all_experts(*args)
        if self.ep_size > 1:  # another rank's experts: -1, skipped
            ids = ids - self.expert_start
            ids = torch.where((ids >= 0) & (ids < self.num_experts), ids, -1)
        out = self.local(x, weights, ids)
        return all_reduce(out) if self.reduce else out

    def local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts over ``x``, ``ids`` local (-1: not here): fp32 ``[T, H]``."""
        args = (x, self.w13, self.w2, weights, ids, self.glu, self.w13_scale_inv, self.w2_scale_inv)
        if use_fused(x, self.w13):
            from tensorrt_llm._torch.modules.fused_moe.ops import fused_experts

            return fused_experts(*args)
        return reference_experts(*args)

    def idle(self, top_k: int, like: torch.Tensor, capacity: int | None) -> None:
        """A step without tokens on this rank: its part in the exchange (EP under attention DP),
        as ``forward`` of no tokens; ``like``: a tensor of the activations' dtype and device."""
        empty = torch.empty((0, top_k), device=like.device)
        self.forward(like.new_empty((0, self.w13.shape[2])), empty, empty.long(), capacity)


class MiniMaxM3SparseMoeBlock(nn.Module):
    """The MoE MLP of a MiniMax-M3 layer (names as the hub's ``block_sparse_moe``)."""

    def __init__(
        self, hidden_size: int, config: MoeConfig, mapping: Mapping, glu: SwigluOai
    ) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.routed_scaling_factor = config.routed_scaling_factor
        num_experts = config.num_experts
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # replicated
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.experts = StackedExperts(
            num_experts, hidden_size, config.intermediate_size, mapping, glu
        )
        self.shared_experts = GatedMLP(hidden_size, config.shared_intermediate_size, mapping, glu)
        # [E] bool, set by a benchmark: the experts some token chose since it was cleared (a CUDA
        # graph captured while it is set records them on every replay)
        self.expert_hits: torch.Tensor | None = None
        # [E] (token, choice) slots this rank's tokens routed to each expert, over the model's
        # life (the load-balance figures; a device add per step, graph-safe)
        self.register_buffer("routed", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    def idle(self, capacity: int | None) -> None:
        """This layer's part in a step in which this rank has no tokens (``experts.all_to_all``)."""
        self.experts.idle(self.top_k, self.gate.weight, capacity)

    def forward(self, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``; ``capacity``: the step's exchange (``StackedExperts``)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = route(self.gate(flat), self.e_score_correction_bias, self.top_k)
        if self.expert_hits is not None:
            self.expert_hits.index_fill_(0, ids.flatten(), True)  # no host scalar: graph-safe
        self.routed.index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        routed = self.experts(flat, weights, ids, capacity) * self.routed_scaling_factor
        return (routed + self.shared_experts(flat).float()).to(x.dtype).view(x.shape)
