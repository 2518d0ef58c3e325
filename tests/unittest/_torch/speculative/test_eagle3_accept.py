"""Eagle3's acceptance rules as tensor operations over the batch (``acceptance.verify``): greedy
rows exactly, sampled rows by their distribution over many rows of one batch (one row per seed),
and the counter-based random numbers the sampler draws them with."""

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.sampler import (
    SamplingTensors,
    filtered_probs,
    sample,
    uniform,
)
from tensorrt_llm._torch.speculative.acceptance import choose_drafts, verify

N = 20000  # rows (seeds) for the distribution checks: 3 sigma of a frequency is at most 0.011


def rows(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, step: int = 0):
    return SamplingTensors(
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p),
        torch.arange(n, dtype=torch.long) * 7919 + 1,
        torch.full((n,), step * 64, dtype=torch.long),
        all_greedy=temperature == 0,
        uses_top_k=top_k > 0,
    )


def logits_of(probs: list[list[float]], n: int) -> torch.Tensor:
    """``[n, len(probs), V]``: every row the same distributions (log-probabilities)."""
    return torch.tensor(probs).clamp(min=1e-12).log().expand(n, -1, -1)


def test_greedy_rows_accept_the_matching_prefix_then_the_target_token():
    argmax = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8], [4, 0, 0, 0]])
    logits = torch.nn.functional.one_hot(argmax, 10).float()
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [0, 0, 0]])
    tokens, accepted = verify(logits, drafts, torch.tensor([3, 3, 3, 0]), rows(4, temperature=0))
    assert accepted.tolist() == [3, 1, 0, 0]
    new = [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist(), strict=True)]
    assert new == [[5, 6, 7, 8], [5, 9], [1], [4]]


def test_rejection_sampling_emits_tokens_distributed_as_the_target():
    p = [[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]  # at the draft's position, then after
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    st = rows(N)
    drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(0))
    tokens, accepted = verify(
        logits_of(p, N),
        drafts[:, None],
        torch.ones(N, dtype=torch.long),
        st,
        q.expand(N, 1, 4),
        torch.ones(N, dtype=torch.bool),
    )
    frequency = torch.bincount(tokens[:, 0], minlength=4) / N
    torch.testing.assert_close(frequency, torch.tensor(p[0]), atol=0.015, rtol=0)
    # accepted with probability sum_d q(d) min(1, p(d) / q(d)) = sum_d min(p(d), q(d)) = 0.6
    assert abs(accepted.float().mean().item() - 0.6) < 0.015


def test_a_draft_the_target_agrees_with_is_always_accepted():
    p = [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    tokens, accepted = verify(
        logits_of(p, 8),
        torch.ones(8, 1, dtype=torch.long),
        torch.ones(8, dtype=torch.long),
        rows(8),
        torch.tensor([0.0, 1.0, 0.0]).expand(8, 1, 3),
        torch.ones(8, dtype=torch.bool),
    )
    assert accepted.tolist() == [1] * 8 and tokens.tolist() == [[1, 2]] * 8


def test_without_the_drafters_q_a_draft_is_kept_exactly_when_the_draw_equals_it():
    p = [[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]
    tokens, accepted = verify(
        logits_of(p, N),
        torch.ones(N, 1, dtype=torch.long),
        torch.ones(N, dtype=torch.long),
        rows(N),
    )
    frequency = torch.bincount(tokens[:, 0], minlength=4) / N
    torch.testing.assert_close(frequency, torch.tensor(p[0]), atol=0.015, rtol=0)
    assert abs(accepted.float().mean().item() - 0.2) < 0.015


def test_greedy_and_sampled_rows_share_a_batch():
    p = [[0.1, 0.7, 0.2], [0.2, 0.2, 0.6]]
    st = rows(4)
    st.temperature[:2] = 0.0  # rows 0 and 1 greedy
    tokens, accepted = verify(
        logits_of(p, 4), torch.ones(4, 1, dtype=torch.long), torch.ones(4, dtype=torch.long), st
    )
    assert tokens[:2].tolist() == [[1, 2], [1, 2]] and accepted[:2].tolist() == [1, 1]


@pytest.mark.parametrize("top_k", [0, 5], ids=["nucleus", "sorted"])
def test_a_seed_draws_the_same_tokens_whatever_else_is_in_the_batch(top_k):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    st = rows(6, temperature=0.9, top_p=0.95, top_k=top_k)
    alone = [sample(logits[i : i + 1], rows_of(st, i)).item() for i in range(6)]
    assert sample(logits, st).tolist() == alone
    later = rows(6, temperature=0.9, top_p=0.95, step=1)  # the next step: new numbers
    assert not torch.equal(uniform(st.seed, st.counter, 0), uniform(later.seed, later.counter, 0))


def rows_of(st: SamplingTensors, i: int) -> SamplingTensors:
    return st.select(slice(i, i + 1))


def test_uniform_numbers_are_uniform_and_differ_by_lane():
    seed = torch.arange(N, dtype=torch.long)
    u = uniform(seed, torch.zeros(N, dtype=torch.long), 0)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert (u != uniform(seed, torch.zeros(N, dtype=torch.long), 1)).float().mean() > 0.99


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).log_softmax(-1).expand(2, -1)
    st = rows(2, top_k=2)
    st.top_p[1] = 0.5
    st.top_k[1] = 0
    probs = filtered_probs(logits, st)
    assert probs[0, 2:].sum() == 0 and probs[0, :2].sum().item() == 1.0  # the best two
    kept = (probs[1] > 0).nonzero().flatten().tolist()
    assert kept == [0]  # the first token alone holds more than half the mass


def test_drafts_are_drawn_from_the_drafters_distribution_and_q_is_returned():
    draft_logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(N, -1)
    tokens, q = choose_drafts(draft_logits, rows(N), 0, lambda ids: ids + 10)
    frequency = torch.bincount(tokens - 10, minlength=3) / N
    torch.testing.assert_close(frequency, q[0], atol=0.015, rtol=0)
    greedy, none = choose_drafts(draft_logits, rows(N, temperature=0), 0, lambda ids: ids + 10)
    assert none is None and greedy.unique().tolist() == [12]


def test_sampled_tokens_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.8), (5, 0.9)):
        st = rows(N, temperature=0.8, top_k=top_k, top_p=top_p)
        tokens = sample(logits.expand(N, -1), st)
        frequency = torch.bincount(tokens, minlength=8) / N
        want = filtered_probs(logits, rows_of(st, 0))[0]
        torch.testing.assert_close(frequency, want, atol=0.015, rtol=0)
        assert (frequency[want == 0] == 0).all()  # nothing outside top-k and top-p


def test_a_draw_at_the_top_of_the_unit_interval_stays_in_top_k(monkeypatch):
    import tensorrt_llm._torch.pyexecutor.sampler as sampler

    # top-k = 3 of a spread distribution: its mass sums to just under 1 in float32 on many rows
    logits = torch.randn(2000, 64, generator=torch.Generator().manual_seed(1)) * 4
    st = rows(2000, temperature=1.0, top_k=3)

    def top(seed, counter, lane):  # every draw at the top (the rows' and their rounds')
        shape = torch.broadcast_shapes(seed.shape, counter.shape, torch.as_tensor(lane).shape)
        return torch.full(shape, 1 - 2**-25)

    monkeypatch.setattr(sampler, "uniform", top)
    tokens = sample(logits, st)
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens[:, None]).any(dim=-1).all()
