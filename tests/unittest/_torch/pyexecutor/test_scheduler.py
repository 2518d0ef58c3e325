"""The scheduler on its own, driven as vLLM's scheduler tests drive theirs: requests in, one
``schedule`` call, the exact batch out. KV capacity is a stub that needs a fixed number of blocks
per request, so admission can be read off the numbers."""

from dataclasses import dataclass, field
from types import SimpleNamespace

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.scheduler import GuaranteedNoEvictScheduler
from tensorrt_llm._torch.pyexecutor.seq_slot_manager import SeqSlotManager
from tensorrt_llm.sampling_params import SamplingParams


@dataclass
class Capacity:
    """``need[request_id]`` blocks to completion (0 if not given); ``free`` blocks in all."""

    free: int
    need: dict[int, int] = field(default_factory=dict)

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        return self.need.get(request.request_id, 0)

    def get_num_free_blocks(self) -> int:
        return self.free


def prompt(request_id: int, length: int) -> LlmRequest:
    return LlmRequest(request_id, list(range(length)), 8, SamplingParams(max_tokens=8))


def decoding(request_id: int, drafts: int = 0) -> LlmRequest:
    request = prompt(request_id, 4)
    request.state = LlmRequestState.GENERATION_IN_PROGRESS
    request.context_current_position = 4
    request.output_token_ids = [1]
    request.py_draft_tokens = [2] * drafts
    return request


def slots(*admitted: int, capacity: int = 16) -> SeqSlotManager:
    """Request slots, those of ``admitted`` (request ids) held."""
    manager = SeqSlotManager(capacity)
    for request_id in admitted:
        manager.admit(SimpleNamespace(request_id=request_id))
    return manager


def ids(requests: list[LlmRequest]) -> list[int]:
    return [r.request_id for r in requests]


def scheduler(free=100, max_batch_size=8, max_num_tokens=64, chunked=True, **need):
    capacity = Capacity(free, {int(k[1:]): v for k, v in need.items()})
    return GuaranteedNoEvictScheduler(max_batch_size, max_num_tokens, capacity, chunked)


def test_running_requests_come_first_then_prompts_in_arrival_order_within_the_token_budget():
    running = [decoding(0, drafts=3), decoding(1, drafts=3)]  # 4 tokens each
    new = [prompt(2, 30), prompt(3, 30)]
    batch = scheduler(max_num_tokens=64, r2=1, r3=1).schedule([*new, *running], slots(0, 1))
    assert ids(batch.generation_requests) == [0, 1]
    assert ids(batch.context_requests) == [2, 3]
    # 64 - 8 for the decodes leaves 56: the first prompt whole, the second's first 26 tokens
    assert [r.context_chunk_size for r in batch.context_requests] == [30, 26]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_the_budget_waits():
    new = [prompt(0, 30), prompt(1, 30)]
    batch = scheduler(max_num_tokens=40, chunked=False, r0=1, r1=1).schedule(new, slots())
    assert ids(batch.context_requests) == [0]


def test_a_prompt_is_admitted_only_when_its_kv_to_completion_fits_beside_what_is_owed():
    running = decoding(0)
    new = [prompt(1, 8), prompt(2, 8), prompt(3, 8)]
    admitted = slots(0)
    # 10 free: request 0 is still owed 4, request 1 needs 3 (7), request 2 needs 5 (12 > 10)
    sched = scheduler(free=10, r0=4, r1=3, r2=5, r3=1)
    batch = sched.schedule([running, *new], admitted)
    assert ids(batch.generation_requests) == [0] and ids(batch.context_requests) == [1]
    assert len(admitted) == 2 and 1 in admitted and new[0].admitted_at is not None
    # first come, first served: request 3 would fit, but request 2 is ahead of it
    assert new[1].admitted_at is None and new[2].admitted_at is None


def test_an_admitted_prompt_is_not_charged_again_on_its_next_chunk():
    request = prompt(0, 50)
    admitted = slots()
    sched = scheduler(free=6, max_num_tokens=20, r0=6)
    first = sched.schedule([request], admitted)
    assert ids(first.context_requests) == [0] and first.context_requests[0].context_chunk_size == 20
    request.context_current_position = 20
    second = sched.schedule([request], admitted)  # owed 6 of 6 free: still runs, it is admitted
    assert second.context_requests[0].context_chunk_size == 20


def test_the_batch_size_caps_decodes_and_prompts_together():
    running = [decoding(i) for i in range(3)]
    new = [prompt(3, 4), prompt(4, 4)]
    batch = scheduler(max_batch_size=4, r3=1, r4=1).schedule([*running, *new], slots(0, 1, 2))
    assert ids(batch.generation_requests) == [0, 1, 2] and ids(batch.context_requests) == [3]
    assert new[1].admitted_at is None  # not admitted: it was never scheduled


def test_admission_waits_for_a_free_request_slot_and_takes_the_one_given_back():
    running, new = decoding(0), [prompt(1, 4), prompt(2, 4)]
    admitted = slots(0, capacity=2)
    batch = scheduler().schedule([running, *new], admitted)
    assert ids(batch.context_requests) == [1] and new[1].admitted_at is None  # no slot left
    slot = admitted.slot(running)
    admitted.release(running)  # request 0 ended: its slot is the next one's
    batch = scheduler().schedule(new, admitted)
    assert ids(batch.context_requests) == [1, 2] and admitted.slot(new[1]) == slot


def test_finished_requests_are_never_scheduled():
    done = decoding(0)
    done.state = LlmRequestState.GENERATION_COMPLETE
    batch = scheduler().schedule([done], slots(0))
    assert batch.batch_size == 0


def test_batch_waiting_holds_prompts_beside_decodes_until_its_timeout_or_token_share():
    from tensorrt_llm._torch.pyexecutor.config import BatchWait

    capacity = Capacity(100)
    wait = GuaranteedNoEvictScheduler(8, 64, capacity, batch_wait=BatchWait(timeout_iters=2))
    running, admitted = [decoding(0, drafts=3)], slots(0)
    active = running + [prompt(1, 10)]
    held = [wait.schedule(active, admitted) for _ in range(2)]
    assert all(ids(b.context_requests) == [] and ids(b.generation_requests) == [0] for b in held)
    assert 1 in admitted  # its KV is reserved while it waits
    active.append(prompt(2, 10))  # joins the wait; both go once the timeout is reached
    assert ids(wait.schedule(active, admitted).context_requests) == [1, 2]
    # no decode running: prompts never wait; and the start-up warm-up turns waiting off
    assert ids(wait.schedule([prompt(3, 10)], slots()).context_requests) == [3]
    assert ids(
        wait.schedule(running + [prompt(4, 10)], slots(0), may_wait=False).context_requests
    ) == [4]
    # the token share: 4 + 40 tokens reach half of 64 at once, 4 + 10 do not
    share = BatchWait(timeout_iters=100, max_tokens_ratio=0.5)
    wait = GuaranteedNoEvictScheduler(8, 64, capacity, batch_wait=share)
    assert ids(wait.schedule(running + [prompt(5, 10)], slots(0)).context_requests) == []
    assert ids(
        wait.schedule(running + [prompt(5, 10), prompt(6, 30)], slots(0)).context_requests
    ) == [
        5,
        6,
    ]


def test_batch_wait_options_are_checked():
    import pytest

    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    with pytest.raises(ValueError, match="batch_wait_max_tokens_ratio"):
        TorchLlmArgs(batch_wait_max_tokens_ratio=1.5)
    config = TorchLlmArgs(batch_wait_timeout_iters=8).to_executor_config(64, "float32", "cpu")
    assert (config.batch_wait.timeout_iters, config.batch_wait.max_tokens_ratio) == (8, 0.0)
