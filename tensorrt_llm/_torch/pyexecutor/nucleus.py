"""Top-p (nucleus) sampling without a sort: rejection against a rising pivot, in Triton on CUDA
(``nucleus_kernel_sample``), the same algorithm in torch elsewhere (``nucleus_torch``).

With ``w_i = exp((x_i - max x) / T)`` and ``Z = sum w``, token ``i`` is kept when the mass above
it is short of top-p: ``sum(w_j for w_j > w_i) < top_p * Z``. The kept tokens are the most likely
ones, as a sort would keep them (tied tokens at the edge are kept together). Each round:

1. draw ``t`` from the candidates ``C = {w > pivot}`` by inverse transform in vocabulary order,
   with the round's random number (``u[:, round]``);
2. ``above = sum(w_j for w_j > w_t)``; if ``above < top_p * Z``, ``t`` is kept: it is the token.
   Otherwise every kept token has ``w > w_t``: the pivot rises to ``w_t`` and ``C``'s mass is
   ``above`` (the next round's normalizer).

A draw from ``C`` that lands in the kept set follows the kept tokens' renormalized distribution,
whatever ``C`` was, so the token is an exact top-p sample. The rounds are few: a rejection
removes at least the rejected token and all tokens below it, and the first draw is kept with
probability top-p. After ``u.shape[1]`` rounds without a kept draw (possible only for a tiny
top-p) the row takes its argmax, which is always kept. Greedy rows (T = 0) take the argmax at
once. Top-k is not handled here: rows with a top-k go through ``sampler.sample``'s sort.

On CUDA a row is cut into ``SPLIT``-token pieces, a program each, for every pass over it: the
statistics (max, argmax, the weights' sum), and each round's masses. A program per row then
finds where a draw lands from the pieces' masses and scans only that piece. The first
``FAST_ROUNDS`` rounds run so; a row still drawing after them finishes in one program of its own
(``finish_kernel``), which the others leave at once.

``row_logprobs`` (the logprobs' normalizer and top logits) is here too, from the same pieces'
statistics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT = 2048  # tokens per program in the split passes
BLOCK = 2048  # tokens per step of a program that walks a whole row
NUM_WARPS = 8
FAST_ROUNDS = 3
# a draw's rounds: round r on lane L uses lane L + r * LANE_STRIDE (``sampler.uniform``)
ROUNDS, LANE_STRIDE = 32, 256


@triton.jit
def _weights(base, start, offs, V, row_max, inv_t):
    idx = start + offs
    x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    return idx, tl.exp((x - row_max) * inv_t)  # 0 past the row's end


@triton.jit
def uniform(seed, counter, lane):
    """``sampler.uniform`` bit for bit: a uint64 splitmix of (seed, counter, lane)."""
    x = (
        seed.to(tl.uint64) * 0x9E3779B97F4A7C15
        + counter.to(tl.uint64) * 0xD1B54A32D192ED03
        + lane.to(tl.uint64) * 0x8CB92BA72F3D8DD7
    )
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    return ((x >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216)


@triton.jit
def stats_kernel(
    logits_ptr, stride_row,  # [n, V]
    inv_t_ptr,  # [n] fp32
    max_ptr, sum_ptr, arg_ptr,  # [n, S]: each piece's max, sum of exp((x - its max) * inv_t), argmax
    top_ptr, top_idx_ptr,  # [n, S, TOP]: each piece's TOP largest logits (fp32) and their ids
    V, S, SPLIT: tl.constexpr, TOP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    idx = piece * SPLIT + tl.arange(0, SPLIT)
    x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < V, other=float("-inf"))
    x = x.to(tl.float32)
    piece_max = tl.max(x)
    total = tl.sum(tl.exp((x - piece_max) * tl.load(inv_t_ptr + row)))
    tl.store(max_ptr + row * S + piece, piece_max)
    tl.store(sum_ptr + row * S + piece, total)
    arg = tl.minimum(tl.min(tl.where(x == piece_max, idx, V)), V - 1)  # (V - 1: all NaN)
    tl.store(arg_ptr + row * S + piece, arg.to(tl.int64))
    out = (row * S + piece) * TOP
    for t in tl.static_range(TOP):  # the largest left, then it is taken out
        value = tl.max(x)
        at = tl.minimum(tl.min(tl.where(x == value, idx, V)), V - 1)
        tl.store(top_ptr + out + t, value)
        tl.store(top_idx_ptr + out + t, at.to(tl.int64))
        x = tl.where(idx == at, float("-inf"), x)


@triton.jit
def mass_kernel(
    logits_ptr, stride_row,  # [n, V]
    inv_t_ptr, max_ptr, floor_ptr,  # [n] fp32
    done_ptr,  # [n] int32
    out_ptr,  # [n, S]: each piece's sum of the weights above the row's floor
    V, S, SPLIT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    if tl.load(done_ptr + row) == 0:
        base = logits_ptr + row * stride_row
        row_max, inv_t = tl.load(max_ptr + row), tl.load(inv_t_ptr + row)
        _, w = _weights(base, piece * SPLIT, tl.arange(0, SPLIT), V, row_max, inv_t)
        floor = tl.load(floor_ptr + row)
        tl.store(out_ptr + row * S + piece, tl.sum(tl.where(w > floor, w, 0.0)))


@triton.jit
def _fold(
    row, token_ptr, done_ptr, pivot_ptr, mass_ptr, pick_ptr, w_pick_ptr, top_p, total,
    above_ptr, S, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The end of the last round, from its pick and the pieces' mass above it: the pick is kept,
    or the pivot rises to it and the candidates' mass is that mass. Returns the state (done,
    pivot, mass, token) and stores it; the caller goes on with the values, never a reload (a
    program's threads may not see each other's stores)."""
    pieces = tl.arange(0, BLOCK_S)
    above = tl.sum(tl.load(above_ptr + row * S + pieces, mask=pieces < S, other=0.0))
    done = tl.load(done_ptr + row) != 0
    kept = (not done) & (above < top_p * total)
    token = tl.where(kept, tl.load(pick_ptr + row), tl.load(token_ptr + row))
    pivot = tl.where(done | kept, tl.load(pivot_ptr + row), tl.load(w_pick_ptr + row))
    mass = tl.where(done | kept, tl.load(mass_ptr + row), above)
    done = done | kept
    tl.store(token_ptr + row, token)
    tl.store(done_ptr + row, done.to(tl.int32))
    tl.store(pivot_ptr + row, pivot)
    tl.store(mass_ptr + row, mass)
    return done, pivot, mass, token


@triton.jit
def _start(
    row, token_ptr, done_ptr, pivot_ptr, mass_ptr, pick_ptr, w_pick_ptr, top_p, total,
    above_ptr, S, BLOCK_S: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """A round's state (done, pivot, mass, token): the last round folded in, or as stored."""
    if FOLD:
        done, pivot, mass, token = _fold(
            row, token_ptr, done_ptr, pivot_ptr, mass_ptr, pick_ptr, w_pick_ptr, top_p, total,
            above_ptr, S, BLOCK_S,
        )  # fmt: skip
    else:
        done = tl.load(done_ptr + row) != 0
        pivot, mass = tl.load(pivot_ptr + row), tl.load(mass_ptr + row)
        token = tl.load(token_ptr + row)
    return done, pivot, mass, token


@triton.jit
def pick_kernel(
    logits_ptr, stride_row,  # [n, V]
    inv_t_ptr, top_p_ptr, max_ptr, total_ptr,  # [n] fp32
    seed_ptr, counter_ptr,  # [n] int64
    token_ptr, done_ptr, pivot_ptr, mass_ptr,  # [n] the draw's state: int64, int32, fp32, fp32
    pick_ptr, w_pick_ptr,  # [n] int64, fp32: the round's pick and its weight
    pieces_ptr,  # [n, S]: the candidates' mass per piece
    V, S, lane, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """A round's draw (after folding the last round in, when ``FOLD``; its mass above the pick
    per piece is then this round's candidates'): the piece from the pieces' masses, then the
    token by a scan of that piece."""
    row = tl.program_id(0).to(tl.int64)
    top_p, total = tl.load(top_p_ptr + row), tl.load(total_ptr + row)
    done, pivot, mass, _ = _start(
        row, token_ptr, done_ptr, pivot_ptr, mass_ptr, pick_ptr, w_pick_ptr, top_p, total,
        pieces_ptr, S, BLOCK_S, FOLD,
    )  # fmt: skip
    if not done:
        u = uniform(tl.load(seed_ptr + row), tl.load(counter_ptr + row), lane)
        target = u * mass
        pieces = tl.arange(0, BLOCK_S)
        per_piece = tl.load(pieces_ptr + row * S + pieces, mask=pieces < S, other=0.0)
        running = tl.cumsum(per_piece, 0)
        crossing = tl.min(tl.where((running > target) & (per_piece > 0), pieces, S))
        # the sums may round short of the target: then the last piece with a candidate
        piece = tl.where(crossing < S, crossing, tl.max(tl.where(per_piece > 0, pieces, 0)))
        before = tl.sum(tl.where(pieces < piece, per_piece, 0.0))
        row_max, inv_t = tl.load(max_ptr + row), tl.load(inv_t_ptr + row)
        base = logits_ptr + row * stride_row
        idx, w = _weights(base, piece * SPLIT, tl.arange(0, SPLIT), V, row_max, inv_t)
        w = tl.where(w > pivot, w, 0.0)
        first = tl.min(tl.where(((before + tl.cumsum(w, 0)) > target) & (w > 0), idx, V))
        pick = tl.where(first < V, first, tl.max(tl.where(w > 0, idx, -1))).to(tl.int64)
        pick = tl.maximum(pick, 0)  # (no candidate at all: logits that are not finite)
        tl.store(pick_ptr + row, pick)
        w_pick = tl.exp((tl.load(base + pick).to(tl.float32) - row_max) * inv_t)
        tl.store(w_pick_ptr + row, w_pick)


@triton.jit
def finish_kernel(
    logits_ptr, stride_row,  # [n, V]
    inv_t_ptr, top_p_ptr, max_ptr, total_ptr,  # [n] fp32
    seed_ptr, counter_ptr,  # [n] int64
    token_ptr, done_ptr, pivot_ptr, mass_ptr,  # [n] the draw's state: int64, int32, fp32, fp32
    pick_ptr, w_pick_ptr,  # [n] the last round's pick and its weight
    above_ptr,  # [n, S] the last round's mass above its pick per piece
    V, S, lane, first_round, rounds, lane_stride,
    BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """The last round folded in (``FOLD``), then the rounds from ``first_round`` on for a row
    still drawing, by one program walking the row (two passes a round; only the block a draw
    lands in is scanned)."""
    row = tl.program_id(0).to(tl.int64)
    top_p, total = tl.load(top_p_ptr + row), tl.load(total_ptr + row)
    done, pivot, mass, token = _start(
        row, token_ptr, done_ptr, pivot_ptr, mass_ptr, pick_ptr, w_pick_ptr, top_p, total,
        above_ptr, S, BLOCK_S, FOLD,
    )  # fmt: skip
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    inv_t, row_max = tl.load(inv_t_ptr + row), tl.load(max_ptr + row)
    seed, counter = tl.load(seed_ptr + row), tl.load(counter_ptr + row)
    r = first_round
    while (not done) & (r < rounds):
        target = uniform(seed, counter, lane + r * lane_stride) * mass
        run = 0.0
        before = 0.0  # the running sum ahead of the block the draw lands in
        hit_block = -1
        last_block = 0  # the last block with a candidate (the sums may round short of target)
        for start in range(0, V, BLOCK):
            _, w = _weights(base, start, offs, V, row_max, inv_t)
            block_sum = tl.sum(tl.where(w > pivot, w, 0.0))
            crosses = (hit_block < 0) & (run + block_sum > target)
            before = tl.where(crosses, run, before)
            hit_block = tl.where(crosses, start, hit_block)
            last_block = tl.where(block_sum > 0, start, last_block)
            run += block_sum
        found = hit_block >= 0
        idx, w = _weights(base, tl.where(found, hit_block, last_block), offs, V, row_max, inv_t)
        w = tl.where(w > pivot, w, 0.0)
        hit = ((before + tl.cumsum(w, 0)) > target) & (w > 0) & found
        first_hit = tl.min(tl.where(hit, idx, V))
        pick = tl.where(first_hit < V, first_hit, tl.max(tl.where(w > 0, idx, -1))).to(tl.int64)
        pick = tl.maximum(pick, 0)  # (no candidate at all: logits that are not finite)
        w_pick = tl.exp((tl.load(base + pick).to(tl.float32) - row_max) * inv_t)
        above = 0.0
        for start in range(0, V, BLOCK):
            _, w = _weights(base, start, offs, V, row_max, inv_t)
            above += tl.sum(tl.where(w > w_pick, w, 0.0))
        done = above < top_p * total
        token = tl.where(done, pick, token)
        pivot = w_pick
        mass = above
        r += 1
    tl.store(token_ptr + row, token)


def _row_stats(logits: torch.Tensor, inv_t: torch.Tensor, top: int = 0):
    """Each row's max, its first argmax, each piece's weight sum moved to the row's max
    ``[n, S]``, their total, and with ``top`` each piece's ``top`` largest logits and their ids
    ``[n, S * top]``."""
    n, vocab = logits.shape
    pieces = triton.cdiv(vocab, SPLIT)
    maxima = torch.empty(n, pieces, dtype=torch.float32, device=logits.device)
    sums, args = torch.empty_like(maxima), torch.empty_like(maxima, dtype=torch.long)
    tops = torch.empty(n, pieces * top, dtype=torch.float32, device=logits.device)
    top_ids = torch.empty_like(tops, dtype=torch.long)
    stats_kernel[(n, pieces)](
        logits, logits.stride(0), inv_t, maxima, sums, args, tops, top_ids, vocab, pieces,
        SPLIT=SPLIT, TOP=top, num_warps=NUM_WARPS,
    )  # fmt: skip
    row_max, piece = maxima.max(dim=-1)  # the first piece holding it: the first argmax
    masses = sums * torch.exp((maxima - row_max[:, None]) * inv_t[:, None])
    argmax = args.gather(1, piece[:, None])[:, 0]
    return row_max, argmax, masses, masses.sum(dim=-1), (tops, top_ids)


def row_logprobs(logits: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [n, V]`` -> each row's log-sum-exp ``[n]`` (fp32) and its ``top`` largest logits
    (fp32) with their ids ``[n, top]``: on CUDA one pass over the pieces, without an fp32 copy of
    the logits or a top-k over the whole vocabulary."""
    if not logits.is_cuda:
        values, ids = logits.topk(top, dim=-1)
        return torch.logsumexp(logits.float(), dim=-1), values.float(), ids
    logits = _rows(logits)
    ones = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    row_max, _, _, total, (tops, top_ids) = _row_stats(logits, ones, top)
    values, at = tops.topk(top, dim=-1)
    return row_max + total.log(), values, top_ids.gather(1, at)


def nucleus_kernel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    lane: int,
) -> torch.Tensor:
    """``logits [n, V]``; ``temperature``, ``top_p [n]`` fp32; ``seed``, ``counter [n]`` int64
    (``sampler.uniform``'s, round r on lane ``lane + r * LANE_STRIDE``) -> tokens ``[n]`` int64:
    ``FAST_ROUNDS`` rounds of split passes, then ``finish_kernel``. No host sync."""
    logits = _rows(logits)
    n, vocab = logits.shape
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    pieces = triton.cdiv(vocab, SPLIT)
    block_s = triton.next_power_of_2(pieces)
    inv_t = 1.0 / torch.where(temperature > 0, temperature, 1.0)
    row_max, token, masses, total, _ = _row_stats(logits, inv_t)
    pivot = torch.full_like(total, -1.0)  # every weight is above it
    mass = total.clone()
    done = (temperature <= 0).to(torch.int32)
    pick, w_pick = torch.zeros_like(token), torch.zeros_like(total)
    above = (torch.zeros_like(masses), torch.zeros_like(masses))
    rows = (logits, logits.stride(0), inv_t, top_p, row_max, total, seed, counter)
    state = (token, done, pivot, mass, pick, w_pick)
    rounds = min(FAST_ROUNDS, ROUNDS)
    for r in range(rounds):
        candidates = masses if r == 0 else above[(r - 1) % 2]
        pick_kernel[(n,)](
            *rows, *state, candidates, vocab, pieces, lane + r * LANE_STRIDE,
            SPLIT=SPLIT, BLOCK_S=block_s, FOLD=r > 0, num_warps=NUM_WARPS,
        )  # fmt: skip
        mass_kernel[(n, pieces)](
            logits, logits.stride(0), inv_t, row_max, w_pick, done, above[r % 2], vocab,
            pieces, SPLIT=SPLIT, num_warps=NUM_WARPS,
        )  # fmt: skip
    finish_kernel[(n,)](
        *rows, *state, above[(rounds - 1) % 2], vocab, pieces, lane, rounds, ROUNDS,
        LANE_STRIDE, BLOCK=BLOCK, BLOCK_S=block_s, FOLD=rounds > 0, num_warps=NUM_WARPS,
    )  # fmt: skip
    return token


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


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
        pick = torch.where(hit.any(dim=-1), hit.int().argmax(dim=-1), last).clamp(min=0)
        w_pick = w.gather(1, pick[:, None])
        above = torch.where(w > w_pick, w, 0.0).sum(dim=-1)
        kept = (above < top_p * total) & ~done
        token = torch.where(kept, pick, token)
        done = done | kept
        pivot = torch.where(done, pivot, w_pick[:, 0])  # (a finished row's stays: never empty)
        mass = torch.where(done, mass, above)
    return token
