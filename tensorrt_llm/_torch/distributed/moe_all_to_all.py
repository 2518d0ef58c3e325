"""Expert parallelism under attention DP: each rank's tokens go to the ranks that hold their
experts, and the results come back, by ``all_to_all_single`` (NCCL on GPUs, gloo on the CPU).

Per MoE layer and step, on every rank of the expert group (a rank without tokens takes part with
none, ``idle``):

1. each token is sent once to each rank holding one of its chosen experts, with its ``k`` routing
   weights and its expert ids local to that rank (-1 for a choice held elsewhere);
2. the counts per destination go first, so that each rank sizes what it receives;
3. the tokens, then their ids and weights, go split by those counts;
4. each rank runs its experts over what it received: one fp32 partial sum per row;
5. the partial sums come back by the reverse split, and each token adds its partials in rank
   order.

A rank's partial for a token is the sum over its own experts in expert order, and the ranks hold
consecutive experts, so the sums are added in the order one rank adds them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

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


def idle(
    hidden: int, top_k: int, experts_per_rank: int, ep_size: int, compute: Compute, like
) -> None:
    """A rank with no tokens in a step: its part in one layer's exchanges (it may still receive
    the others' tokens, and runs its experts over them)."""
    all_to_all_experts(
        like.new_empty((0, hidden)),
        torch.empty((0, top_k), dtype=torch.float32, device=like.device),
        torch.empty((0, top_k), dtype=torch.long, device=like.device),
        experts_per_rank,
        ep_size,
        compute,
    )
