"""Penalties and logit bias on the device (``LogitsState``): each row of a step's logits moves by
its request's bias and penalties, a verify row counting the drafts ahead of it, as a plain loop
over the requests computes them; the counts follow the tokens each step records."""

import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
from tensorrt_llm._torch.pyexecutor.seq_slot_manager import SeqSlotManager
from tensorrt_llm._torch.pyexecutor.step_inputs import (
    RowLayout,
    StepInputs,
    row_values,
    row_views,
)
from tensorrt_llm._torch.pyexecutor.step_program import step_penalty_rows
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


def admitted(requests: list[LlmRequest], capacity: int) -> LogitsState:
    """A ``LogitsState`` over ``capacity`` request slots, ``requests`` admitted."""
    seq_slots = SeqSlotManager(capacity)
    for req in requests:
        seq_slots.admit(req)
    return LogitsState(seq_slots, VOCAB, torch.device("cpu"))


def step_inputs(requests: list[LlmRequest], state: LogitsState, width: int) -> StepInputs:
    """A step's rows for ``requests`` (each of ``width`` positions), their penalties' values
    through the builder's columns, as an eager step has them."""
    k, n, layout = width - 1, len(requests), RowLayout(penalties=True)
    drafts = [list(r.py_draft_tokens) + [0] * (k - len(r.py_draft_tokens)) for r in requests]
    ints, floats = row_values(requests, 0, layout, state, None)
    _, _, penalties = row_views(torch.tensor(ints), torch.tensor(floats), n, layout)
    return StepInputs(
        input_ids=torch.zeros(0, dtype=torch.long),
        drafts=torch.tensor(drafts, dtype=torch.long).view(n, k),
        num_drafts=torch.tensor([len(r.py_draft_tokens) for r in requests]),
        rows=list(range(n)),
        penalties=penalties,
    )


def test_each_row_moves_as_a_loop_over_the_requests_computes():
    requests = [
        request(0, [4, 4, 7], [4, 9, 9], presence_penalty=1.5, frequency_penalty=0.25),
        request(1, [2], [], logit_bias={3: 5.0, 11: -2.0}),  # a prompt's row: no drafts
        request(2, [5], [8, 1, 3]),  # neither: the scratch slot
        request(3, [], [6, 6, 6], presence_penalty=2.0, logit_bias={6: 1.0}),
    ]
    state = admitted(requests, 4)
    logits = torch.randn(16, VOCAB)
    want = torch.cat([reference(r, logits[4 * i : 4 * i + 4]) for i, r in enumerate(requests)])
    inputs = step_inputs(requests, state, 4)
    slots = inputs.penalties.slots.tolist()
    assert slots[2] == state.scratch and len(set(slots)) == 4
    got = logits.clone()
    state.adjust(got, step_penalty_rows(inputs))
    torch.testing.assert_close(got, want)


def test_one_position_rows_and_the_counts_follow_the_steps():
    requests = [
        request(0, [4], [], presence_penalty=1.0, frequency_penalty=0.5),
        request(1, [1, 1], [], frequency_penalty=1.0, logit_bias={0: 3.0}),
    ]
    state = admitted(requests, 2)
    inputs = step_inputs(requests, state, 1)  # without speculation: no drafts, one position
    logits = torch.randn(2, VOCAB)
    got = logits.clone()
    state.adjust(got, step_penalty_rows(inputs))
    want = torch.cat([reference(r, logits[i : i + 1]) for i, r in enumerate(requests)])
    torch.testing.assert_close(got, want)
    slots = inputs.penalties.slots
    # an Eagle3 step made [4, 9] (one draft accepted) and [2, 3, 2, 5] (all three and the bonus)
    state.record(slots, torch.tensor([[4, 9, 0, 0], [2, 3, 2, 5]]), torch.tensor([2, 4]))
    slots = slots.tolist()
    assert (
        state.counts[slots[0]].tolist()
        == torch.bincount(torch.tensor([4, 4, 9]), minlength=VOCAB).tolist()
    )
    assert (
        state.counts[slots[1]].tolist()
        == torch.bincount(torch.tensor([1, 1, 2, 3, 2, 5]), minlength=VOCAB).tolist()
    )


def test_a_freed_slot_starts_from_the_next_requests_own_output():
    first = request(0, [3, 3], [], frequency_penalty=1.0)
    state = admitted([first], 1)
    (slot,) = state.slots([first])
    state.record(torch.tensor([slot]), torch.tensor([[5]]), torch.tensor([1]))
    state.seq_slots.release(first)  # it ended; its row is written over at the next one's start
    second = request(1, [7], [], presence_penalty=1.0)
    state.seq_slots.admit(second)
    assert state.slots([second]) == [slot]
    assert state.counts[slot].nonzero().flatten().tolist() == [7]
    assert state.bias[slot].abs().sum() == 0


def test_the_kernel_moves_the_rows_as_the_torch_form_does(monkeypatch):
    """``_penalty_kernel`` (what CUDA runs) under Triton's interpreter against the torch form:
    the same fp32 values, bf16 within a rounding (the interpreter's bf16 is emulated), rows at
    the scratch slot untouched."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    requests = [
        request(0, [4, 4, 7], [4, 9, 9], presence_penalty=1.5, frequency_penalty=0.25),
        request(1, [5], [8, 1, 3]),  # the scratch slot
        request(2, [], [6, 6, 6], presence_penalty=2.0, logit_bias={6: 1.0, 11: -3.5}),
    ]
    state = admitted(requests, 4)
    inputs = step_inputs(requests, state, 4)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(12, VOCAB).to(dtype)
        want, got = logits.clone(), logits.clone()
        state.adjust(want, step_penalty_rows(inputs), kernel=False)
        state.adjust(got, step_penalty_rows(inputs), kernel=True)
        if dtype == torch.float32:
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=1 / 64, atol=1 / 64)
        assert torch.equal(got[4:8], logits[4:8]) and not torch.equal(got[:4], logits[:4])
