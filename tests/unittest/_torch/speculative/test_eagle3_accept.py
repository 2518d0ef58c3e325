"""The acceptance rules of one-model Eagle3, as pure functions."""

import torch

from tensorrt_llm._torch.speculative.eagle3 import greedy_accept, rejection_accept


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert greedy_accept([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert greedy_accept([], [4]) == [4]


def test_rejection_sampling_emits_tokens_distributed_as_the_target():
    p = torch.tensor(
        [[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]
    )  # target at the draft position, then after
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1]])  # the drafter's distribution
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        first = rejection_accept([d], q, p, gen)[0]
        counts[first] += 1
    assert torch.allclose(counts / n, p[0], atol=0.015)


def test_a_draft_the_target_agrees_with_is_always_accepted():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    assert rejection_accept([1], q, p, torch.Generator().manual_seed(1)) == [1, 2]


def test_sample_and_match_emits_tokens_distributed_as_the_target():
    from tensorrt_llm._torch.speculative.eagle3 import sample_match_accept

    p = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 20000
    accepted = 0
    for _ in range(n):
        out = sample_match_accept([1], p, gen)
        counts[out[0]] += 1
        accepted += len(out) == 2
    assert torch.allclose(counts / n, p[0], atol=0.015)
    assert abs(accepted / n - 0.2) < 0.015  # a draft is kept exactly when the draw equals it
