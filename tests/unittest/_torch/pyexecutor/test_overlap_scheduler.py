"""The executor's step with the overlap scheduler (a tiny random M3 on the CPU, no LLM): step n+1
is launched before step n is read, its inputs taken from n's tokens on the device. Tokens equal
the step-by-step executor's; a stop lands one step late without its extra token; cancellation,
errors and KV stay exact."""

import dataclasses

import pytest
from m3_helpers import executor_config, tiny_config

from tensorrt_llm._torch.models.checkpoint import random_model
from tensorrt_llm._torch.pyexecutor._util import create_py_executor
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


def make(model, overlap: bool, **kw):
    config = dataclasses.replace(
        executor_config(tokens_per_block=4, max_tokens=256, **kw), overlap_scheduler=overlap
    )
    return create_py_executor(model, config)


def request(request_id: int, prompt_len: int = 9, max_new_tokens: int = 5, **params) -> LlmRequest:
    params.setdefault("ignore_eos", True)
    sampling = SamplingParams(max_tokens=max_new_tokens, **params)
    prompt = [(request_id * 7 + i) % 60 + 1 for i in range(prompt_len)]
    return LlmRequest(request_id, prompt, max_new_tokens, sampling)


def used_slots(executor) -> int:
    executor.kv_cache_manager.check_integrity()
    return executor.kv_cache_manager.get_kv_cache_stats().num_used_slots


def run(executor, requests, arrivals=None) -> int:
    """Step until done, enqueueing ``requests[i]`` before step ``arrivals[i]``; returns the steps."""
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(zip(arrivals, range(len(requests))))
    steps = 0
    while pending or executor.has_work:
        while pending and pending[0][0] <= steps:
            executor.enqueue_request(requests[pending.pop(0)[1]])
        executor.step()
        steps += 1
    assert used_slots(executor) == 0
    return steps


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"temperature": 0.8, "top_p": 0.9, "seed": 11},
        {"temperature": 1.0, "top_k": 5, "seed": 3},
    ],
    ids=["greedy", "seeded-top-p", "seeded-top-k"],
)
def test_tokens_equal_the_step_by_step_executors(model, params):
    def batch():  # lengths and arrivals differ: requests join and leave launched steps
        return [
            request(i, prompt_len=5 + 3 * i, max_new_tokens=3 + 2 * i, **params) for i in range(4)
        ]

    arrivals = [0, 0, 2, 5]
    want, got = batch(), batch()
    run(make(model, False), want, arrivals)
    overlapped = make(model, True)
    run(overlapped, got, arrivals)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert all(r.finish_reason is FinishReason.LENGTH for r in got)
    assert [len(r.output_token_ids) for r in got] == [3, 5, 7, 9]
    assert overlapped.stats.num_generated_tokens == sum(len(r.output_token_ids) for r in got)
    assert overlapped.stats.num_overlapped_steps > 10  # the decode steps ran behind each other


def test_a_step_is_read_after_the_next_one_is_launched(model):
    executor = make(model, True)
    req = request(0)
    executor.enqueue_request(req)
    assert executor.step() == [] and req.output_token_ids == []  # launched, not read
    executor.step()
    assert len(req.output_token_ids) == 1  # the prefill's token, read after step 2 was launched
    assert len(executor._unread) == 1


def test_a_late_stop_is_never_emitted_and_its_kv_is_freed(model):
    probe = request(0, max_new_tokens=6)
    run(make(model, False), [probe])
    third = probe.output_token_ids[2]
    first = probe.output_token_ids.index(third)
    executor = make(model, True)
    req = request(0, max_new_tokens=6, stop_token_ids=[third])
    finished = []
    executor.enqueue_request(req)
    while executor.has_work:
        finished += executor.step()
    assert finished == [req]
    assert req.output_token_ids == probe.output_token_ids[: first + 1]
    assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, third)
    # the step after the stop ran on the device before the stop was read: one step more
    assert executor.stats.num_steps == first + 1 + 1
    assert executor.stats.num_generated_tokens == first + 1  # its extra token is not counted
    assert used_slots(executor) == 0


def test_a_length_end_launches_no_step_past_it(model):
    executor = make(model, True)
    req = request(0, max_new_tokens=4)
    run(executor, [req])
    assert len(req.output_token_ids) == 4
    assert executor.stats.num_steps == 4  # the prefill and three decodes: none computed past them


def test_a_cancelled_request_is_gone_within_one_step_and_its_slots_are_free(model):
    executor = make(model, True)
    keep, drop = request(0, max_new_tokens=8), request(1, max_new_tokens=8)
    for req in (keep, drop):
        executor.enqueue_request(req)
    executor.step()
    executor.step()
    assert executor.cancel_request(drop.request_id)
    assert drop.finish_reason is FinishReason.CANCELLED and drop not in executor.active
    tokens = list(drop.output_token_ids)
    executor.step()  # reads the step that still wrote its KV, then frees it
    assert drop.output_token_ids == tokens  # nothing emitted after the cancel
    assert all(not s.holds(drop) for s in executor._unread)
    assert used_slots(executor) == 3  # only the other one's: 9 + 2 tokens, and one reserved
    assert not executor.cancel_request(drop.request_id)
    while executor.has_work:
        executor.step()
    assert len(keep.output_token_ids) == 8 and used_slots(executor) == 0


def test_a_step_that_always_raises_ends_every_request_and_frees_every_slot(model, monkeypatch):
    executor = make(model, True)
    first, second = request(0), request(1)
    executor.enqueue_request(first)
    executor.step()
    executor.step()  # first has a launched step not yet read
    executor.enqueue_request(second)
    engine = executor.model_engine

    def broken(batch, moe_capacity=None):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "build_inputs", broken)
    executor.step()  # the batch failed: each of its requests runs again alone
    assert executor.isolation.suspects == {first.request_id, second.request_id}
    for _ in range(2):  # and fails alone
        with pytest.raises(RuntimeError, match="device lost"):
            executor.step()
    assert first.finish_reason is second.finish_reason is FinishReason.ERROR
    assert "RuntimeError: device lost" in str(first.stop_reason)
    assert used_slots(executor) == 0 and not executor._unread and not executor.active
    monkeypatch.undo()
    third = request(2)
    run(executor, [third])
    assert third.finish_reason is FinishReason.LENGTH and len(third.output_token_ids) == 5


def test_penalties_and_bias_overlap_and_decode_the_same_tokens(model):
    """Their counts stay on the device, so a penalized step feeds the next like any other."""

    def batch():
        return [
            request(0, max_new_tokens=6, presence_penalty=1.5, frequency_penalty=0.5),
            request(1, max_new_tokens=6, logit_bias={3: 5.0, 7: -100.0}),
            request(2, max_new_tokens=6),
        ]

    want, got = batch(), batch()
    run(make(model, False), want)
    executor = make(model, True)
    run(executor, got)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert executor.stats.num_overlapped_steps > 0
    assert 7 not in got[1].output_token_ids


def test_a_read_that_raises_frees_its_requests_and_the_executor_goes_on(model, monkeypatch):
    executor = make(model, True)
    first, second = request(0), request(1)
    for req in (first, second):
        executor.enqueue_request(req)
    executor.step()
    manager = executor.resource_manager

    def broken(batch):
        raise RuntimeError("commit failed")

    monkeypatch.setattr(manager, "update_resources", broken)
    with pytest.raises(RuntimeError, match="commit failed"):
        executor.step()  # launches step 2, then reads step 1
    monkeypatch.undo()
    assert first.finish_reason is second.finish_reason is FinishReason.ERROR
    assert not executor.active
    while executor.has_work:  # the launched step that still holds them is read, then freed
        executor.step()
    assert used_slots(executor) == 0
    third = request(2)
    run(executor, [third])
    assert len(third.output_token_ids) == 5


def test_logprobs_with_a_prompt_in_chunks(model):
    """A step of a prompt's first chunk makes no token (and no logprobs) for it."""
    config = dataclasses.replace(
        executor_config(tokens_per_block=4, max_tokens=256),
        overlap_scheduler=True,
        max_num_tokens=8,
        enable_chunked_prefill=True,
    )
    executor = create_py_executor(model, config)
    req = request(0, prompt_len=20, max_new_tokens=3, logprobs=2)
    run(executor, [req])
    assert len(req.output_token_ids) == len(req.py_logprobs) == 3
    assert all(lp <= 0 and len(top) == 2 for lp, top in req.py_logprobs)
