"""Penalties and logit bias on the device (``LogitsState``): each row of a step's logits moves by
its request's bias and penalties, a verify row counting the drafts ahead of it, as a plain loop
over the requests computes them; the counts follow the tokens each step records."""

import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.logits_processing import (
    LogitsState,
    PenaltyRows,
    draft_pairs,
    penalty_rows,
)
from tensorrt_llm.sampling_params import SamplingParams

VOCAB = 12


def request(request_id: int, output: list[int], drafts: list[int], **params) -> LlmRequest:
    req = LlmRequest(request_id, [1, 2, 3], 20, SamplingParams(max_tokens=20, **params))
    req.output_token_ids = list(output)
    req.py_draft_tokens = list(drafts)
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    return req


def reference(req: LlmRequest, rows: torch.Tensor) -> torch.Tensor:
    """Row ``j``: the output and the first ``j`` drafts counted, token by token."""
    params, out = req.sampling_params, rows.clone()
    for j in range(rows.shape[0]):
        seen = list(req.output_token_ids) + list(req.py_draft_tokens[:j])
        for token in range(VOCAB):
            count = seen.count(token)
            out[j, token] += (params.logit_bias or {}).get(token, 0.0)
            out[j, token] -= (params.frequency_penalty or 0.0) * count
            out[j, token] -= (params.presence_penalty or 0.0) * (count > 0)
    return out


def test_each_row_moves_as_a_loop_over_the_requests_computes():
    requests = [
        request(0, [4, 4, 7], [4, 9, 9], presence_penalty=1.5, frequency_penalty=0.25),
        request(1, [2], [], logit_bias={3: 5.0, 11: -2.0}),  # a prompt's first row: no drafts
        request(2, [5], [8, 1, 3]),  # neither: the scratch slot
        request(3, [], [6, 6, 6], presence_penalty=2.0, logit_bias={6: 1.0}),
    ]
    num_logits = [4, 1, 4, 4]
    state = LogitsState(4, VOCAB, torch.device("cpu"))
    logits = torch.randn(sum(num_logits), VOCAB)
    want = torch.cat(
        [reference(r, logits[s : s + n]) for r, s, n in zip(requests, [0, 4, 5, 9], num_logits)]
    )
    slots = state.slots(requests)
    assert slots[2] == state.scratch and len(set(slots)) == 4
    got = logits.clone()
    state.adjust(got, penalty_rows(requests, num_logits, slots, torch.device("cpu")))
    torch.testing.assert_close(got, want)


def test_the_device_pairs_match_the_host_ones_and_the_counts_follow_the_steps():
    requests = [
        request(0, [4], [4, 9, 9], presence_penalty=1.0, frequency_penalty=0.5),
        request(1, [1, 1], [2, 3, 2], frequency_penalty=1.0, logit_bias={0: 3.0}),
    ]
    state = LogitsState(2, VOCAB, torch.device("cpu"))
    slots = state.slots(requests)
    logits = torch.randn(8, VOCAB)
    host = logits.clone()
    state.adjust(host, penalty_rows(requests, [4, 4], slots, torch.device("cpu")))
    drafts = torch.tensor([r.py_draft_tokens for r in requests])
    pairs = draft_pairs(drafts, torch.tensor([3, 3]), torch.tensor([0, 4]))
    device = logits.clone()
    rows = PenaltyRows(
        torch.tensor(slots).repeat_interleave(4),
        torch.tensor([1.0, 0.0]).repeat_interleave(4),
        torch.tensor([0.5, 1.0]).repeat_interleave(4),
        *pairs,
    )
    state.adjust(device, rows)
    torch.testing.assert_close(device, host)
    # the step made [4, 9] (one draft accepted) and [2, 3, 2, 5] (all three and the bonus)
    state.record(
        torch.tensor(slots), torch.tensor([[4, 9, 0, 0], [2, 3, 2, 5]]), torch.tensor([2, 4])
    )
    assert (
        state.counts[slots[0]].tolist()
        == torch.bincount(torch.tensor([4, 4, 9]), minlength=VOCAB).tolist()
    )
    assert (
        state.counts[slots[1]].tolist()
        == torch.bincount(torch.tensor([1, 1, 2, 3, 2, 5]), minlength=VOCAB).tolist()
    )


def test_a_freed_slot_starts_from_the_next_requests_own_output():
    state = LogitsState(1, VOCAB, torch.device("cpu"))
    first = request(0, [3, 3], [], frequency_penalty=1.0)
    (slot,) = state.slots([first])
    state.record(torch.tensor([slot]), torch.tensor([[5]]), torch.tensor([1]))
    state.free_resources(first)
    second = request(1, [7], [], presence_penalty=1.0)
    assert state.slots([second]) == [slot]
    assert state.counts[slot].nonzero().flatten().tolist() == [7]
    assert state.bias[slot].abs().sum() == 0
