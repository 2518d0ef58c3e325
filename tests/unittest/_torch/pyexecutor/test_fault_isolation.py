"""A step that fails costs the request that made it fail, not its batch (``fault_isolation.py``):
the batch's requests run again one at a time, the one that fails alone ends with the step's
error, and the others go on with the tokens they would have had (a tiny random M3 on the CPU)."""

import dataclasses

import pytest
from m3_helpers import executor_config, tiny_config

from tensorrt_llm._torch.models.checkpoint import random_model
from tensorrt_llm._torch.pyexecutor._util import create_py_executor
from tensorrt_llm._torch.pyexecutor.llm_request import (
    ErrorKind,
    FinishReason,
    LlmRequest,
    RequestError,
)
from tensorrt_llm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


def make(model, overlap: bool):
    config = executor_config(tokens_per_block=4, max_tokens=256)
    return create_py_executor(model, dataclasses.replace(config, overlap_scheduler=overlap))


def batch() -> list[LlmRequest]:
    """Greedy and seeded sampled requests; request 2 is the one a fault will follow."""
    out = []
    for i in range(4):
        sampled = {"temperature": 0.9, "top_k": 20, "seed": 100 + i} if i % 2 else {}
        params = SamplingParams(max_tokens=6, ignore_eos=True, **sampled)
        out.append(LlmRequest(i, [(i * 7 + j) % 60 + 1 for j in range(9)], 6, params))
    return out


def run(executor, requests) -> None:
    for req in requests:
        executor.enqueue_request(req)
    failures = 0
    while executor.has_work:
        try:
            executor.step()
        except RuntimeError:
            failures += 1
    return failures


def poison(executor, monkeypatch, request_id: int, after_steps: int = 0) -> None:
    """From its ``after_steps``-th step on, any step that holds ``request_id`` raises."""
    engine = executor.model_engine
    original, seen = engine.build_inputs, {"steps": 0}

    def forward(batch, moe_capacity=None):
        if any(r.request_id == request_id for r in batch.all_requests):
            seen["steps"] += 1
            if seen["steps"] > after_steps:
                raise RuntimeError("kernel cannot take this shape\nsecond line")
        return original(batch, moe_capacity)

    monkeypatch.setattr(engine, "build_inputs", forward)


def used_slots(executor) -> int:
    executor.kv_cache_manager.check_integrity()
    return executor.kv_cache_manager.get_kv_cache_stats().num_used_slots


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("after_steps", [0, 2])  # in its prefill, or mid-decode
def test_a_failing_request_fails_alone_and_the_others_keep_their_tokens(
    model, monkeypatch, overlap, after_steps
):
    want = batch()
    assert run(make(model, overlap), want) == 0
    executor, got = make(model, overlap), batch()
    poison(executor, monkeypatch, request_id=2, after_steps=after_steps)
    assert run(executor, got) == 1  # only its lone step raised
    bad = got[2]
    assert bad.finish_reason is FinishReason.ERROR and isinstance(bad.stop_reason, RequestError)
    assert bad.stop_reason.kind is ErrorKind.ENGINE_FAULT
    assert bad.stop_reason.message == (
        "this request failed the engine step (RuntimeError: kernel cannot take this shape)"
    )
    for i in (0, 1, 3):
        assert got[i].finish_reason is FinishReason.LENGTH
        assert got[i].output_token_ids == want[i].output_token_ids, i
    assert executor.isolation.num_retried == 4 and executor.isolation.num_failed_alone == 1
    assert not executor.isolation.suspects and used_slots(executor) == 0


def test_a_lone_request_that_fails_ends_with_the_error_at_once(model, monkeypatch):
    executor = make(model, False)
    (req,) = batch()[:1]
    poison(executor, monkeypatch, request_id=0)
    assert run(executor, [req]) == 1
    assert req.stop_reason.kind is ErrorKind.ENGINE_FAULT and used_slots(executor) == 0
    assert executor.isolation.num_retried == 0


def test_a_server_of_several_ranks_ends_the_failed_batch_with_a_message_that_says_so(
    model, monkeypatch
):
    executor = make(model, False)
    executor.lockstep = True  # every rank runs every step: a retry here would leave the others
    requests = batch()
    poison(executor, monkeypatch, request_id=2)
    for req in requests:
        executor.enqueue_request(req)
    with pytest.raises(RuntimeError):
        executor.step()
    for req in requests:
        assert req.finish_reason is FinishReason.ERROR
        assert req.stop_reason.kind is ErrorKind.ENGINE_FAULT
        assert "the engine step this request was in failed (RuntimeError" in str(req.stop_reason)
    assert used_slots(executor) == 0


def test_a_batch_that_fails_for_its_size_is_held_to_half_of_it(model, monkeypatch):
    want = batch()
    assert run(make(model, False), want) == 0
    executor, got = make(model, False), batch()
    engine = executor.model_engine
    original = engine.build_inputs

    def forward(step, moe_capacity=None):  # a step of more than two requests runs out of memory
        if step.batch_size > 2:
            raise RuntimeError("out of memory")
        return original(step, moe_capacity)

    monkeypatch.setattr(engine, "build_inputs", forward)
    assert run(executor, got) == 0  # every request ran alone once, then two at a time
    assert executor.isolation.cap == 2 and executor.isolation.num_failed_alone == 0
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert all(r.finish_reason is FinishReason.LENGTH for r in got)
