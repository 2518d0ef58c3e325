"""The context server's reply to a context-only request, and releasing what was pulled."""

from types import SimpleNamespace

from disagg_helpers import SECRET, handle

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.context_only import context_result, release_pulled
from tensorrt_llm._torch.disaggregation.coordinator import DisaggCoordinator
from tensorrt_llm._torch.disaggregation.params import RequestType
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor


def ran(reason: FinishReason, tokens: list[int]) -> LlmRequest:
    request = LlmRequest(request_id=7, prompt_token_ids=[1, 2, 3], max_new_tokens=8)
    request.context_only = True
    request.output_token_ids = tokens
    request.py_draft_tokens = [12, 13]
    request.finish(reason)
    return request


def test_a_prefilled_request_answers_with_the_handle_to_its_kv():
    exported = []

    def export(request_id, hold_s):
        exported.append((request_id, hold_s))
        return handle(request_id=request_id)

    transceiver = SimpleNamespace(export=export, secret=SECRET)
    reply = context_result(ran(FinishReason.CONTEXT_DONE, [11]), transceiver, 30)
    assert exported == [(7, 30)]
    trust.verify(reply, SECRET)  # signed with the deployment's secret
    assert reply.model_copy(update={"signature": None}).to_json() == {
        "request_type": "context_only",
        "first_token": 11,
        "draft_tokens": [12, 13],
        "prompt_token_ids": [1, 2, 3],
        "transfer_handle": handle().model_dump(mode="json", exclude_defaults=True),
    }


def test_a_request_that_ended_at_its_first_token_answers_finished():
    reply = context_result(ran(FinishReason.STOP, [2]), transceiver=None)
    assert reply.request_type is RequestType.FINISHED
    assert reply.to_json() == {
        "request_type": "finished",
        "output_token_ids": [2],
        "finish_reason": "stop",
    }


def test_the_pulled_requests_are_the_ones_released():
    released = []

    def release_transferred(request_ids, revoke):
        released.append((request_ids, revoke))
        return len(request_ids)

    executor = SimpleNamespace(release_transferred=release_transferred)
    transceiver = SimpleNamespace(pulled_request_ids=lambda: [4, 9], revoke=print)
    assert release_pulled(executor, transceiver) == 2 and released == [([4, 9], print)]


def test_a_hold_is_revoked_before_its_slots_are_freed():
    # the ticket must be gone before the slots can be given to another request (transceiver.py)
    events = []
    freeing = SimpleNamespace(free_resources=lambda r: events.append(("free", r.request_id)))
    coordinator = DisaggCoordinator(freeing, transfer_timeout_s=60)
    coordinator.hold(SimpleNamespace(request_id=4))
    coordinator.transfer_timeout_s = -1  # request 5's hold has expired
    coordinator.hold(SimpleNamespace(request_id=5))
    executor = SimpleNamespace(disagg=coordinator, rank_sync=None)
    assert PyExecutor.release_transferred(executor, [4], lambda r: events.append(("revoke", r)))
    assert events == [("revoke", 4), ("free", 4), ("revoke", 5), ("free", 5)]
    assert not coordinator.held
