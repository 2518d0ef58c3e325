"""Only disaggregated params a context server of the deployment signed start a generation-only
request (issue 11, items 1 and 4): a forged or altered handle or prompt is refused before any
slot is taken or read."""

import pytest
from disagg_helpers import SECRET, context_reply, handle

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.generation_only import resume_from_context
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest


def test_a_signed_reply_verifies_after_the_router_turns_it_into_generation_only():
    reply = context_reply()
    assert reply.signature is not None
    trust.verify(reply.for_generation(), SECRET)


@pytest.mark.parametrize(
    "change",
    [
        {"transfer_handle": handle(slots=[0, 1, 2])},  # another user's slots (item 1)
        {"transfer_handle": handle(pool_addresses=[1])},
        {"transfer_handle": handle(agent_name="evil")},
        {"prompt_token_ids": [9, 9, 9]},  # claims another prompt for the pulled KV (item 4)
        {"first_token": 12},
        {"draft_tokens": []},
    ],
    ids=["slots", "pool_addresses", "agent", "prompt", "first_token", "drafts"],
)
def test_an_altered_reply_is_refused(change):
    forged = context_reply().model_copy(update=change)
    with pytest.raises(trust.UntrustedParamsError, match="do not match their signature"):
        trust.verify(forged, SECRET)


def test_an_unsigned_or_foreign_reply_is_refused():
    unsigned = context_reply().model_copy(update={"signature": None})
    with pytest.raises(trust.UntrustedParamsError, match="carry no signature"):
        trust.verify(unsigned, SECRET)
    foreign = trust.sign(unsigned, b"another-deployments-secret")
    with pytest.raises(trust.UntrustedParamsError, match="another TRTLLM_DISAGG_SECRET"):
        trust.verify(foreign, SECRET)


def test_a_forged_reply_changes_nothing_on_the_generation_side():
    class NoPulls:
        secret = SECRET

        def __getattr__(self, name):
            raise AssertionError(f"a forged reply reached the transceiver's {name}")

    request = LlmRequest(request_id=3, prompt_token_ids=[1, 2, 3], max_new_tokens=8)
    forged = context_reply().model_copy(update={"transfer_handle": handle(slots=[0, 1, 2])})
    with pytest.raises(trust.UntrustedParamsError):
        resume_from_context(request, forged, executor=None, transceiver=NoPulls())
    assert request.output_token_ids == [] and request.py_draft_tokens == []


@pytest.mark.parametrize("value", ["", "short"])
def test_the_deployment_secret_must_be_set_and_long(monkeypatch, value):
    monkeypatch.setenv("TRTLLM_DISAGG_SECRET", value)
    with pytest.raises(ValueError, match="TRTLLM_DISAGG_SECRET (is not set|has 5 characters)"):
        trust.deployment_secret()


def test_the_router_header_must_present_the_secret():
    assert trust.authorized(SECRET.decode(), SECRET)
    assert not trust.authorized(None, SECRET)
    assert not trust.authorized("x" * len(SECRET), SECRET)
