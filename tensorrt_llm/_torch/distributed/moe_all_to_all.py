"""Expert parallelism under attention DP: each rank's tokens go to the ranks that hold their
experts, and the results come back, by ``all_to_all_single`` (NCCL on GPUs, gloo on the CPU).

Per MoE layer and step, on every rank of the expert group (a rank without tokens takes part with
none, ``StackedExperts.idle``):

1. each token is sent once to each rank holding one of its chosen experts, with its ``k`` routing
   weights and its expert ids local to that rank (-1 for a choice held elsewhere);
2. the counts per destination go first, so that each rank sizes what it receives;
3. the tokens, then their ids and weights, go split by those counts;
4. each rank runs its experts over what it received: one fp32 partial sum per row;
5. the partial sums come back by the reverse split, and each token adds its partials in rank
   order.

A rank's partial for a token is the sum over its own experts in expert order, and the ranks hold
consecutive experts, so the sums are added in the order one rank adds them.

In a CUDA graph nothing may be sized on the host, so ``all_to_all_fixed`` sends every rank a
buffer of a fixed ``capacity`` rows (at most one per token: a rank's most tokens in a graph step),
its unused rows with ids -1 (no expert runs them), and needs no counts: every split is the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tensorrt_llm._torch.distributed.communicator import max_over_ranks

# ``(x [R, H], weights [R, k] fp32, local ids [R, k])`` -> fp32 ``[R, H]``
Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _exchange(out: torch.Tensor, inp: torch.Tensor, recv: list[int], send: list[int]) -> None:
    dist.all_to_all_single(out, inp.contiguous(), recv, send)


def all_to_all_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts_per_rank: int,
    ep_size: int,
    compute: Compute,
) -> torch.Tensor:
    """``x [T, H]`` routed to the global experts ``ids [T, k]`` with ``weights [T, k]`` ->
    ``sum_k weights * expert_ids(x)``, fp32 ``[T, H]``, each expert run by the rank that holds
    it (rank ``e // experts_per_rank``) through ``compute``."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    dest = ids.long() // experts_per_rank  # [T, k]
    hit = torch.zeros(num_tokens, ep_size, dtype=torch.bool, device=x.device)
    hit.scatter_(1, dest, True)
    pair_dest, pair_token = hit.t().nonzero(as_tuple=True)  # [P], by destination, then token
    send_counts = hit.sum(0)  # [ep]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    local = ids[pair_token].long() - (pair_dest * experts_per_rank)[:, None]  # [P, k]
    local = torch.where((local >= 0) & (local < experts_per_rank), local, -1)
    meta = torch.cat([local.float(), weights[pair_token].float()], dim=1)  # [P, 2k]
    got_x = x.new_empty((sum(recv), hidden))
    _exchange(got_x, x[pair_token], recv, send)
    got_meta = meta.new_empty((sum(recv), 2 * top_k))
    _exchange(got_meta, meta, recv, send)
    partial = compute(got_x, got_meta[:, top_k:], got_meta[:, :top_k].long())  # [R, H] fp32
    back = partial.new_empty((pair_token.numel(), hidden))
    _exchange(back, partial, send, recv)
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    return out.index_add_(0, pair_token, back)


def all_to_all_fixed(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts_per_rank: int,
    ep_size: int,
    compute: Compute,
    capacity: int,
) -> torch.Tensor:
    """``all_to_all_experts`` through buffers of ``capacity`` rows per destination (``T <=
    capacity``), with nothing read on the host: a CUDA graph captures it. The same sums, added
    in the same order."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    if num_tokens > capacity:
        raise ValueError(f"{num_tokens} tokens exceed the exchange's capacity of {capacity}")
    dest = ids.long() // experts_per_rank  # [T, k]
    hit = torch.zeros(num_tokens, ep_size, dtype=torch.bool, device=x.device)
    hit.scatter_(1, dest, True)
    # row of (token, destination) in the send buffer; a pair not sent goes to a spare last row
    order = torch.cumsum(hit.long(), dim=0) - 1  # [T, ep]: the token's place among those sent
    ranks = torch.arange(ep_size, device=x.device)
    spare = ep_size * capacity
    row = torch.where(hit, ranks * capacity + order, spare).reshape(-1)  # [T * ep]
    send_x = x.new_zeros((spare + 1, hidden))
    send_x[row] = x.repeat_interleave(ep_size, dim=0)
    local = ids.long()[:, None, :] - (ranks * experts_per_rank)[None, :, None]  # [T, ep, k]
    local = torch.where((local >= 0) & (local < experts_per_rank), local, -1)
    meta = torch.cat([local.float(), weights.float()[:, None, :].expand(-1, ep_size, -1)], -1)
    send_meta = torch.full((spare + 1, 2 * top_k), -1.0, device=x.device)
    send_meta[row] = meta.reshape(-1, 2 * top_k)
    got_x, got_meta = torch.empty_like(send_x[:spare]), torch.empty_like(send_meta[:spare])
    dist.all_to_all_single(got_x, send_x[:spare])
    dist.all_to_all_single(got_meta, send_meta[:spare])
    partial = compute(got_x, got_meta[:, top_k:], got_meta[:, :top_k].long())  # [ep * C, H]
    back = torch.zeros((spare + 1, hidden), dtype=torch.float32, device=x.device)
    dist.all_to_all_single(back[:spare], partial.contiguous())
    parts = back[row].view(num_tokens, ep_size, hidden)  # the spare row: zeros
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    for rank in range(ep_size):  # in rank order, as all_to_all_experts adds them
        out += parts[:, rank]
    return out


class ExchangeSync:
    """A rank's side of the MoE layers' exchanges under attention DP with EP: before each step's
    forward the ranks agree, in one all-reduce over the control group, on how the layers exchange
    in it: through the fixed buffers of ``capacity`` rows when no rank has more tokens (then the
    CUDA graphs, all captured at start-up with those buffers, may replay; their buffers cannot be
    sized per step), else sized by the counts (every rank runs eagerly). The agreement is the
    step's (``step_plan.StepPlan.moe_capacity``); this object keeps none of it.

    ``moe_blocks``: the exchanging MoE layers, in forward order."""

    def __init__(self, moe_blocks: list, capacity: int) -> None:
        self.blocks = moe_blocks
        self.capacity = capacity

    def agree(self, tokens: int) -> int | None:
        """``tokens``: this rank's tokens in the step (0 with nothing to run). Returns the step's
        exchange: ``capacity`` when no rank has more tokens, else None (sized by the counts)."""
        (most,) = max_over_ranks([tokens])
        return self.capacity if most <= self.capacity else None

    def idle_step(self, capacity: int | None) -> None:
        """A step without a forward here: one pass of every layer without tokens, as the others
        exchange (``capacity``: the step's agreed exchange)."""
        for block in self.blocks:
            block.idle(capacity)
