"""The executor's step on its own (a tiny random M3 on the CPU, no LLM): what one step does to
its requests and its KV, and what ends a request between steps."""

import pytest
from m3_helpers import executor_config, tiny_config

from tensorrt_llm._torch.models.checkpoint import random_model
from tensorrt_llm._torch.pyexecutor._util import create_py_executor
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest, LlmRequestState
from tensorrt_llm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


@pytest.fixture
def executor(model):
    return create_py_executor(model, executor_config(tokens_per_block=4, max_tokens=256))


def request(request_id: int, prompt_len: int = 9, max_new_tokens: int = 5, **params) -> LlmRequest:
    sampling = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True, **params)
    prompt = [(request_id * 7 + i) % 60 + 1 for i in range(prompt_len)]
    return LlmRequest(request_id, prompt, max_new_tokens, sampling)


def used_slots(executor) -> int:
    executor.kv_cache_manager.check_integrity()
    return executor.kv_cache_manager.get_kv_cache_stats().num_used_slots


def test_the_step_that_finishes_a_prompt_gives_its_first_token_and_then_one_per_step(executor):
    req = request(0)
    executor.enqueue_request(req)
    finished = executor.step()
    assert finished == [] and len(req.output_token_ids) == 1
    assert req.state is LlmRequestState.GENERATION_IN_PROGRESS
    assert used_slots(executor) == 3  # 9 + 1 tokens in blocks of 4
    for n in (2, 3, 4):
        executor.step()
        assert len(req.output_token_ids) == n
    assert executor.step() == [req] and req.finish_reason is FinishReason.LENGTH
    assert used_slots(executor) == 0 and not executor.has_work


def test_a_cancelled_request_is_gone_before_the_next_step_and_its_slots_are_free(executor):
    keep, drop = request(0, max_new_tokens=4), request(1, max_new_tokens=4)
    for req in (keep, drop):
        executor.enqueue_request(req)
    executor.step()
    assert executor.cancel_request(drop.request_id)
    assert drop.finish_reason is FinishReason.CANCELLED and drop not in executor.active
    assert used_slots(executor) == 3  # only the other one's
    tokens = len(drop.output_token_ids)
    executor.step()
    assert len(drop.output_token_ids) == tokens  # never stepped again
    assert not executor.cancel_request(drop.request_id)  # gone: a second cancel finds nothing


def test_finish_request_ends_it_with_the_reason_the_output_side_found(executor):
    req = request(0)
    executor.enqueue_request(req)
    executor.step()
    assert executor.finish_request(req.request_id, FinishReason.STOP, "stop string")
    assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, "stop string")
    assert used_slots(executor) == 0 and not executor.has_work


def test_a_stop_token_ends_the_request_in_the_step_that_made_it(executor):
    probe = request(0, max_new_tokens=6)
    executor.enqueue_request(probe)
    while executor.has_work:
        executor.step()
    third = probe.output_token_ids[2]
    req = request(1, max_new_tokens=6, stop_token_ids=[third])
    req.prompt_token_ids = list(probe.prompt_token_ids)
    executor.enqueue_request(req)
    while executor.has_work:
        executor.step()
    first = probe.output_token_ids.index(third)
    assert req.output_token_ids == probe.output_token_ids[: first + 1]
    assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, third)


def test_a_step_that_raises_ends_only_its_batch_and_frees_every_slot(executor, monkeypatch):
    first = request(0)
    executor.enqueue_request(first)
    engine = executor.model_engine
    original = engine.build_inputs

    def broken(batch, moe_capacity=None):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "build_inputs", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        executor.step()
    assert first.finish_reason is FinishReason.ERROR and used_slots(executor) == 0
    monkeypatch.setattr(engine, "build_inputs", original)
    second = request(1)
    executor.enqueue_request(second)
    while executor.has_work:
        executor.step()
    assert second.finish_reason is FinishReason.LENGTH and len(second.output_token_ids) == 5


def test_a_request_that_can_never_run_is_refused_at_enqueue(executor):
    with pytest.raises(ValueError, match="the prompt is empty"):
        executor.enqueue_request(request(0, prompt_len=0))
    with pytest.raises(ValueError, match="leaves no room to generate within max_seq_len=128"):
        executor.enqueue_request(request(1, prompt_len=128))
    assert not executor.has_work and used_slots(executor) == 0


def test_the_same_requests_in_one_batch_or_alone_decode_the_same_tokens(executor, model):
    together = [request(i, max_new_tokens=4) for i in range(3)]
    for req in together:
        executor.enqueue_request(req)
    while executor.has_work:
        executor.step()
    for i, req in enumerate(together):
        alone = create_py_executor(model, executor_config(tokens_per_block=4, max_tokens=256))
        single = request(i, max_new_tokens=4)
        alone.enqueue_request(single)
        while alone.has_work:
            alone.step()
        assert single.output_token_ids == req.output_token_ids
