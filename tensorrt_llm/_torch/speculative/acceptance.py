"""Eagle3's acceptance and draft choice as tensor operations over ``[batch, draft, vocab]``: one
implementation for eager steps and CUDA graphs, greedy and sampled rows in the same batch.

Acceptance of the drafts ``d_1..d_K`` of a row, given the target's distributions ``p_0..p_K`` at
the step's positions (``p_j`` follows the row's token ``j``; draft ``d_{j+1}`` is its guess):

- **greedy** (temperature 0): accept while ``d_{j+1} == argmax p_j``; then the target's argmax
  after the last accepted draft (the bonus). Token-identical to target-only greedy decoding.
- **sampled, with the drafter's q** (speculative rejection sampling): accept ``d_{j+1}`` with
  probability ``min(1, p_j(d) / q_j(d))``; at the first rejection draw from
  ``normalize(max(p_j - q_j, 0))``, or from ``p_K`` when every draft was accepted. The output
  follows ``p`` exactly.
- **sampled, without q** (drafts made elsewhere: a context server's): draw ``t_j`` from each
  ``p_j`` and accept while ``t_j == d_{j+1}``; the first mismatch's draw is the next token. The
  output follows ``p`` exactly; acceptance is lower than with q.

Every random number comes from ``sampler.uniform`` (seed, counter, lane): reproducible per seed.
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.pyexecutor.sampler import (
    LANE_ACCEPT,
    LANE_DRAFT,
    LANE_RESIDUAL,
    LANE_TOKEN,
    SamplingTensors,
    draw,
    filtered_probs,
    uniform,
)


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    st: SamplingTensors,
    draft_probs: torch.Tensor | None = None,
    has_q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [B, T, V]`` of the target at each row's ``T = K + 1`` positions, ``drafts [B, K]``
    (target ids; a row's first ``num_drafts [B]`` count), ``draft_probs [B, K, V]`` (q, on the
    target vocabulary) where ``has_q [B]``. Returns ``tokens [B, T]``, whose first
    ``num_accepted [B] + 1`` are the row's new tokens (the accepted drafts, then one more)."""
    num_rows, width, vocab = logits.shape
    k = width - 1
    argmax = logits.argmax(dim=-1)  # [B, T]
    valid = torch.arange(k, device=logits.device)[None, :] < num_drafts[:, None]  # [B, K]
    greedy_accepted = greedy_accept(argmax, drafts, valid)
    if st.all_greedy:
        return argmax, greedy_accepted
    positions = st.expand(width)  # a row per (sequence, position): counters + j
    p = filtered_probs(logits.reshape(-1, vocab), positions)  # [B * T, V]
    drawn = draw(p, uniform(positions.seed, positions.counter, LANE_TOKEN)).view(num_rows, width)
    p = p.view(num_rows, width, vocab)
    ok = drawn[:, :k] == drafts  # without q: the draw matches the draft
    if draft_probs is not None:
        u = uniform(positions.seed, positions.counter, LANE_ACCEPT).view(num_rows, width)[:, :k]
        pd = p[:, :k].gather(2, drafts[..., None]).squeeze(-1)
        qd = draft_probs.gather(2, drafts[..., None]).squeeze(-1)
        ok = torch.where(has_q[:, None], (qd > 0) & (u * qd < pd), ok)
    accepted = _prefix_len(ok & valid)  # [B]
    rows = torch.arange(num_rows, device=logits.device)
    final = drawn[rows, accepted]  # the draw at the first mismatch (or after the last draft)
    if draft_probs is not None:
        p_at = p[rows, accepted]  # [B, V]
        q_at = draft_probs[rows, accepted.clamp(max=max(k - 1, 0))]
        residual = (p_at - q_at).clamp_(min=0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        rejected = has_q & (accepted < num_drafts)
        dist = torch.where(rejected[:, None] & (mass > 0), residual / mass.clamp(min=1e-30), p_at)
        u = uniform(st.seed, st.counter + accepted, LANE_RESIDUAL)
        final = torch.where(has_q, draw(dist, u), final)
    tokens = torch.cat([drafts, drafts.new_zeros(num_rows, 1)], dim=1)
    tokens[rows, accepted] = final
    greedy = st.temperature <= 0
    return (
        torch.where(greedy[:, None], argmax, tokens),
        torch.where(greedy, greedy_accepted, accepted),
    )


def greedy_accept(
    argmax: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B]`` drafts accepted greedily: while each equals the target's argmax at the position
    before it (``argmax [B, K + 1]``, ``drafts [B, K]``; ``valid [B, K]``: the drafts a row has)."""
    match = drafts == argmax[:, : drafts.shape[1]]
    return _prefix_len(match if valid is None else match & valid)


def choose_drafts(
    draft_logits: torch.Tensor, st: SamplingTensors | None, k: int, to_target_ids
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ``k`` of each row: ``draft_logits [B, Vd]`` -> (target ids ``[B]``, the drafter's
    distribution q ``[B, Vd]`` on its own vocabulary, or None when every row is greedy). Greedy
    rows take the argmax."""
    greedy = to_target_ids(draft_logits.argmax(dim=-1))
    if st is None or st.all_greedy:
        return greedy, None
    q = filtered_probs(draft_logits, st)
    drawn = to_target_ids(draw(q, uniform(st.seed, st.counter, LANE_DRAFT + k)))
    return torch.where(st.temperature > 0, drawn, greedy), q


def _prefix_len(ok: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` bool -> ``[B]``: how many leading entries are True."""
    return ok.int().cumprod(dim=1).sum(dim=1)
