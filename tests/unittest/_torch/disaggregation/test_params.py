"""The disaggregated control plane's messages: exact JSON round trips, and a malformed message is
refused with an error naming the offending key."""

import json

import pytest
from disagg_helpers import context_reply, fingerprint, handle
from pydantic import ValidationError

from tensorrt_llm._torch.disaggregation.head_regroup import attention_ranks
from tensorrt_llm._torch.disaggregation.params import (
    DisaggregatedParams,
    LayoutFingerprint,
    RequestType,
    parallel_ranks,
)
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason


def test_a_context_reply_round_trips_through_json_exactly():
    reply = context_reply()
    wire = json.loads(json.dumps(reply.to_json()))
    assert wire["request_type"] == "context_only" and wire["transfer_handle"]["slots"] == [4, 1, 9]
    assert DisaggregatedParams.model_validate(wire) == reply
    assert reply.transfer_handle.agent_metadata_bytes() == b"\x00nixl\xff"


def test_the_generation_request_is_the_context_reply_with_its_type_changed():
    reply = context_reply()
    sent = reply.for_generation()
    assert sent.request_type is RequestType.GENERATION_ONLY
    assert DisaggregatedParams(request_type=RequestType.CONTEXT_ONLY).to_json() == {
        "request_type": "context_only"
    }
    assert sent.model_dump(exclude={"request_type"}) == reply.model_dump(exclude={"request_type"})
    ask = DisaggregatedParams(request_type=RequestType.CONTEXT_ONLY)
    with pytest.raises(ValueError, match="request_type='context_only' carries no transfer_handle"):
        ask.for_generation()


def test_a_finished_reply_carries_the_plain_finish_reason():
    done = DisaggregatedParams(
        request_type="finished", output_token_ids=[2], finish_reason=FinishReason.STOP
    )
    assert done.to_json() == {
        "request_type": "finished",
        "output_token_ids": [2],
        "finish_reason": "stop",
    }
    assert json.dumps(FinishReason.CONTEXT_DONE) == '"context_done"'


@pytest.mark.parametrize(
    "wire, message",
    [
        ({"request_type": "prefill"}, "request_type"),
        ({"request_type": "generation_only"}, "missing \\['first_token', 'prompt_token_ids'"),
        ({"request_type": "context_only", "first_token": 3}, "missing \\['prompt_token_ids'"),
        ({"request_type": "finished"}, "request_type='finished' needs finish_reason"),
        (
            {"request_type": "context_only", "finish_reason": "stop"},
            "request_type='context_only' takes no \\['finish_reason'\\]",
        ),
        ({"request_type": "context_only", "handle": {}}, "handle"),
    ],
)
def test_a_malformed_message_is_refused_naming_the_key(wire, message):
    with pytest.raises(ValidationError, match=message):
        DisaggregatedParams.model_validate(wire)


def test_a_handle_with_bad_agent_metadata_or_a_negative_slot_is_refused():
    with pytest.raises(ValidationError, match="agent_metadata='not base64!'... is not base64"):
        handle(agent_metadata="not base64!")
    with pytest.raises(ValidationError, match="slots.1"):
        handle(slots=[0, -1])


def test_fingerprints_name_the_fields_that_differ():
    mine, theirs = fingerprint(4096), fingerprint(8192)
    assert mine.digest != theirs.digest and mine.digest == fingerprint(4096).digest
    (difference,) = mine.differences(theirs)
    assert difference.startswith("pools: local [{'slot_bytes': 4096")
    # the parallel layout is part of it: a TP2 rank's slot holds half the heads of a TP1 slot
    (difference,) = mine.differences(fingerprint(4096, parallel="tp2"))
    assert difference == "parallel: local 'tp1' vs peer 'tp2'"
    # and it records the MoE layout, which leaves the attention's (so the KV's) alone
    ep = fingerprint(4096, parallel="adp2-ep2-moetp1")
    assert ep.digest != fingerprint(4096, parallel="adp2-ep1-moetp1").digest
    assert (parallel_ranks(ep.parallel), attention_ranks(ep.parallel)) == ((True, 2), 1)
    assert attention_ranks("tp4-ep2-moetp2") == 4
    with pytest.raises(ValueError, match="is not a parallel layout"):
        parallel_ranks("adp2-ep2")


def test_a_fingerprint_carries_the_kv_dtype_as_a_plain_name():
    bf16 = fingerprint(4096, kv_dtype="bfloat16")
    assert bf16.kv_dtype == "bfloat16" and bf16.digest != fingerprint(4096).digest
    assert "kv_dtype: local 'bfloat16' vs peer 'float16'" in bf16.differences(fingerprint(4096))
    assert LayoutFingerprint.model_validate_json(bf16.model_dump_json()) == bf16
    with pytest.raises(ValidationError, match="kv_dtype"):  # a name, nothing else, from the wire
        bf16.model_validate({**bf16.model_dump(), "kv_dtype": "fp8; rm -rf /"})
    with pytest.raises(ValidationError, match="kv_dtype"):  # a peer that does not say is refused
        bf16.model_validate({k: v for k, v in bf16.model_dump().items() if k != "kv_dtype"})
