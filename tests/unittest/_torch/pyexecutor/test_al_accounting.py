"""Acceptance length counts only drafts that were emitted (issue 11, item 13): accepted drafts
that a stop token or the length limit then cuts off are not counted."""

from types import SimpleNamespace

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens, LaunchedStep, apply_tokens
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm.sampling_params import SamplingParams


def decoding(max_new_tokens: int, end_id: int = 2) -> LlmRequest:
    req = LlmRequest(
        request_id=1,
        prompt_token_ids=[5, 6, 7],
        max_new_tokens=max_new_tokens,
        sampling_params=SamplingParams(max_tokens=max_new_tokens),
        end_ids=(end_id,),
    )
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    req.output_token_ids = [9]  # the first token, from the prefill
    req.py_draft_tokens = [10, 11, 12]
    return req


def update(req: LlmRequest, tokens: list[int], num_accepted: int) -> SimpleNamespace:
    """Apply one read step's tokens to ``req``; returns the stats it counted into."""
    stats = SimpleNamespace(
        num_decode_iterations=0, num_accepted_draft_tokens=0, num_generated_tokens=0
    )
    batch = ScheduledRequests(generation_requests=[req])
    logits = torch.zeros(len(tokens), 4)
    device_tokens = DeviceTokens(
        [0], torch.tensor([tokens]), torch.tensor([num_accepted]), torch.tensor([[13, 14, 15]])
    )
    step = LaunchedStep(batch, [True], logits, device_tokens)
    apply_tokens(step, step.read(), [req], stats, 1024)
    return stats


@pytest.mark.parametrize(
    "max_new_tokens, tokens, end_id, counted",
    [
        (10, [10, 11, 12, 4], 2, 3),  # all four emitted: three accepted drafts count
        (3, [10, 11, 12, 4], 2, 1),  # the length limit keeps two of them: one accepted draft
        (10, [10, 2, 12, 4], 2, 1),  # the end id second: one accepted draft before it
    ],
    ids=["all", "length", "stop"],
)
def test_only_emitted_drafts_count(max_new_tokens, tokens, end_id, counted):
    req = decoding(max_new_tokens, end_id)
    stats = update(req, tokens, num_accepted=3)
    assert req.num_accepted_draft_tokens == counted and req.num_decode_iterations == 1
    assert stats.num_accepted_draft_tokens == counted
