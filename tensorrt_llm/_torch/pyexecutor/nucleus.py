"""Top-p (nucleus) sampling without a sort: rejection against a rising pivot, one Triton program
per row on CUDA (``nucleus_kernel``), the same algorithm in torch elsewhere (``nucleus_torch``).

With ``w_i = exp((x_i - max x) / T)`` and ``Z = sum w``, token ``i`` is kept when the mass above
it is short of top-p: ``sum(w_j for w_j > w_i) < top_p * Z``. The kept tokens are the most likely
ones, as a sort would keep them (tied tokens at the edge are kept together). Each round:

1. draw ``t`` from the candidates ``C = {w > pivot}`` by inverse transform in vocabulary order,
   with the round's random number (``u[:, round]``);
2. ``above = sum(w_j for w_j > w_t)``; if ``above < top_p * Z``, ``t`` is kept: it is the token.
   Otherwise every kept token has ``w > w_t``: the pivot rises to ``w_t`` and ``C``'s mass is
   ``above`` (the next round's normalizer).

A draw from ``C`` that lands in the kept set follows the kept tokens' renormalized distribution,
whatever ``C`` was, so the token is an exact top-p sample. Each round is two passes over the row,
and the rounds are few: a rejection removes at least the rejected token and all tokens below it.
After ``u.shape[1]`` rounds without a kept draw (rare beyond measure for top-p near 1; possible
for a tiny top-p) the row takes its argmax, which is always kept. Greedy rows (T = 0) take the
argmax at once. Top-k is not handled here: rows with a top-k go through ``sampler.sample``'s sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _weights(base, start, offs, V, row_max, inv_t):
    idx = start + offs
    x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    return idx, tl.exp((x - row_max) * inv_t)  # 0 past the row's end


@triton.jit
def nucleus_kernel(
    logits_ptr, stride_row,  # [n, V]
    temperature_ptr, top_p_ptr,  # [n] fp32
    u_ptr, stride_u,  # [n, ROUNDS] fp32 in [0, 1)
    out_ptr,  # [n] int64
    V, ROUNDS, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    temperature = tl.load(temperature_ptr + row)
    inv_t = 1.0 / tl.where(temperature > 0, temperature, 1.0)
    top_p = tl.load(top_p_ptr + row)
    # the row's maximum and its first index
    row_max = float("-inf")
    token = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        first = tl.min(tl.where(x == block_max, idx, V), 0).to(tl.int64)
        token = tl.where(block_max > row_max, first, token)
        row_max = tl.maximum(row_max, block_max)
    total = 0.0
    for start in range(0, V, BLOCK):
        _, w = _weights(base, start, offs, V, row_max, inv_t)
        total += tl.sum(w, 0)
    pivot = -1.0  # every weight is above it
    mass = total  # the candidates'
    done = temperature <= 0
    r = 0
    while (not done) & (r < ROUNDS):
        target = tl.load(u_ptr + row * stride_u + r) * mass
        run = 0.0
        pick = tl.full((), -1, tl.int64)
        last = tl.full((), -1, tl.int64)
        for start in range(0, V, BLOCK):
            idx, w = _weights(base, start, offs, V, row_max, inv_t)
            w = tl.where(w > pivot, w, 0.0)
            hit = ((run + tl.cumsum(w, 0)) > target) & (w > 0)
            first = tl.min(tl.where(hit, idx, V), 0).to(tl.int64)
            pick = tl.where((pick < 0) & (first < V), first, pick)
            last = tl.maximum(last, tl.max(tl.where(w > 0, idx, -1), 0).to(tl.int64))
            run += tl.sum(w, 0)
        pick = tl.where(pick < 0, last, pick)  # the sums rounded short of the target
        w_pick = tl.exp((tl.load(base + pick).to(tl.float32) - row_max) * inv_t)
        above = 0.0
        for start in range(0, V, BLOCK):
            _, w = _weights(base, start, offs, V, row_max, inv_t)
            above += tl.sum(tl.where(w > w_pick, w, 0.0), 0)
        done = above < top_p * total
        token = tl.where(done, pick, token)
        pivot = w_pick
        mass = above
        r += 1
    tl.store(out_ptr + row, token)


def nucleus_kernel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """``logits [n, V]`` (rows contiguous), ``temperature``/``top_p [n]`` fp32, ``u [n, rounds]``
    -> tokens ``[n]`` int64 (one program per row)."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n:
        nucleus_kernel[(n,)](
            logits, logits.stride(0), temperature, top_p, u, u.stride(0), out,
            vocab, u.shape[1], BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


def nucleus_torch(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """``nucleus_kernel``'s algorithm in torch ops, over the whole batch at once (a round per
    iteration while some row is still drawing: it reads the device, so not for CUDA graphs)."""
    x = logits.float()
    row_max, token = x.max(dim=-1)
    inv_t = 1.0 / torch.where(temperature > 0, temperature, 1.0)
    w = torch.exp((x - row_max[:, None]) * inv_t[:, None])
    total = w.sum(dim=-1)
    pivot = torch.full_like(total, -1.0)
    mass = total.clone()
    done = temperature <= 0
    index = torch.arange(w.shape[-1], device=w.device)
    for r in range(u.shape[1]):
        if bool(done.all()):
            break
        candidates = torch.where(w > pivot[:, None], w, 0.0)
        hit = (candidates.cumsum(dim=-1) > (u[:, r] * mass)[:, None]) & (candidates > 0)
        last = torch.where(candidates > 0, index, -1).max(dim=-1).values
        pick = torch.where(hit.any(dim=-1), hit.int().argmax(dim=-1), last)
        w_pick = w.gather(1, pick[:, None])
        above = torch.where(w > w_pick, w, 0.0).sum(dim=-1)
        kept = (above < top_p * total) & ~done
        token = torch.where(kept, pick, token)
        done = done | kept
        pivot = torch.where(done, pivot, w_pick[:, 0])  # (a finished row's stays: never empty)
        mass = torch.where(done, mass, above)
    return token
