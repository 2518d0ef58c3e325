"""Generation-only requests load their prompt's KV between the executor's steps (a tiny random M3
on the CPU, a stand-in for the pull): a load in flight holds up only its own request, a failed one
fails alone, and a load given up while a READ into its slots is still running keeps those slots
until the READ ends."""

import pytest
from m3_helpers import executor_config, tiny_config

from tensorrt_llm._torch.models.checkpoint import random_model
from tensorrt_llm._torch.pyexecutor._util import create_py_executor
from tensorrt_llm._torch.pyexecutor.llm_request import (
    ErrorKind,
    FinishReason,
    LlmRequest,
    LlmRequestState,
)
from tensorrt_llm.sampling_params import SamplingParams


class StandInLoad:
    """Allocates the prompt's slots, then stays in flight for ``steps`` steps (or fails); the
    READ it stands for cannot be cancelled for ``unsettled`` more looks once given up."""

    def __init__(self, executor, steps: int = 3, fail: bool = False, unsettled: int = 0) -> None:
        self.executor, self.num_steps, self.fail = executor, steps, fail
        self.unsettled = unsettled
        self.abandoned = False

    def steps(self, request):
        kv = self.executor.kv_cache_manager
        kv.add_sequence(request.request_id, request.prompt_key_ids, None)
        assert kv.resize_sequence(request.request_id, request.prompt_len)
        for _ in range(self.num_steps):
            yield
        if self.fail:
            raise TimeoutError("KV pull from ['ctx-agent'] timed out")
        return request.prompt_len

    def abandon(self) -> None:
        self.abandoned = True

    def settled(self, request) -> bool:
        self.unsettled -= 1
        return self.unsettled < 0


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


@pytest.fixture
def executor(model):
    return create_py_executor(model, executor_config(tokens_per_block=4, max_tokens=256))


def resumed(request_id: int) -> LlmRequest:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    request = LlmRequest(request_id, [(request_id + j) % 50 + 1 for j in range(9)], 6, params)
    request.output_token_ids = [7]  # the context server's first token
    request.num_sampling_steps = 1
    return request


def used_slots(executor) -> int:
    executor.kv_cache_manager.check_integrity()
    return executor.kv_cache_manager.get_kv_cache_stats().num_used_slots


def test_a_load_in_flight_holds_up_only_its_own_request(executor):
    plain = LlmRequest(0, list(range(1, 10)), 6, SamplingParams(max_tokens=6, ignore_eos=True))
    executor.enqueue_request(plain)
    slow, failing = resumed(1), resumed(2)
    executor.enqueue_generation_only(slow, StandInLoad(executor, steps=4))
    executor.enqueue_generation_only(failing, StandInLoad(executor, steps=2, fail=True))
    assert slow.state is LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
    tokens = []
    while executor.has_work:
        executor.step()
        tokens.append(len(plain.output_token_ids))
    assert tokens[:4] == [1, 2, 3, 4]  # a token every step while the loads were in flight
    assert failing.finish_reason is FinishReason.ERROR
    assert failing.stop_reason.kind is ErrorKind.KV_TRANSFER
    assert "could not be pulled from the context server" in str(failing.stop_reason)
    assert slow.finish_reason is FinishReason.LENGTH and len(slow.output_token_ids) == 6
    assert executor.stats.num_transferred_tokens == 9 and used_slots(executor) == 0


def test_a_load_given_up_mid_read_keeps_its_slots_until_the_read_ends(executor):
    request = resumed(0)
    load = StandInLoad(executor, steps=100, unsettled=3)
    executor.enqueue_generation_only(request, load)
    executor.step()
    assert used_slots(executor) == 3  # 9 prompt tokens in blocks of 4
    assert executor.cancel_request(request.request_id)
    assert request.finish_reason is FinishReason.CANCELLED and load.abandoned
    assert used_slots(executor) == 3 and executor.has_work  # the READ may still write them
    while executor.has_work:
        executor.step()
    assert used_slots(executor) == 0 and not executor.disagg.draining
