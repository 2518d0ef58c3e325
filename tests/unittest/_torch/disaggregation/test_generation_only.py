"""Resuming a request after a context server's prefill, with a recording stand-in for the NIXL
transceiver: the first token and drafts come from the params, slots are allocated for the whole
prompt, and only the blocks the local prefix cache lacks are pulled."""

import inspect
from types import SimpleNamespace

import pytest
from disagg_helpers import SECRET, context_reply, handle

from tensorrt_llm._torch.disaggregation import DEFAULT_TRANSFER_TIMEOUT_S, trust
from tensorrt_llm._torch.disaggregation.generation_only import (
    KvPullFailed,
    PromptKvPull,
    check_resumable,
    resume_from_context,
)
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams, RequestType
from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
from tensorrt_llm._torch.pyexecutor.config import (
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig

PROMPT = list(range(300))  # 2 full blocks of 128 tokens and a partial one


class RecordingTransceiver:
    secret = SECRET

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.pulls, self.told = refuse, [], []

    def check_peer(self, handle) -> None:
        if self.refuse:
            raise ValueError(f"incompatible KV cache layout on peer {handle.agent_name!r}")

    def pull_steps(
        self, request_id, handle, num_blocks, start_block=0, timeout_s=None, confirm=True
    ):
        self.pulls.append((request_id, handle.request_id, start_block, num_blocks, timeout_s))
        self.told += ["pulled"] if confirm else []
        yield  # one step in flight
        return 0

    def confirm(self, handle) -> None:
        self.told.append("pulled")

    def release(self, handle) -> None:
        self.told.append("released")


def executor():
    manager = KVCacheManagerV2(
        KVCacheManagerV2Config(
            layers=(KvCacheLayer(2, 8),),
            max_seq_len=1024,
            max_batch_size=2,
            options=KvCacheOptions(128, "float16", max_tokens=128 * 8),
        )
    )
    return SimpleNamespace(
        kv_cache_manager=manager,
        resource_manager=SimpleNamespace(kv_cache_managers={"kv": manager}),
        disagg=SimpleNamespace(transfer_timeout_s=5.0),
        model_engine=SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=100))),
        spec_worker=SimpleNamespace(max_draft_len=3),
    )


def test_resuming_takes_the_context_servers_first_token_and_drafts():
    request = LlmRequest(request_id=3, prompt_token_ids=[1, 2, 3], max_new_tokens=8)
    load_kv = resume_from_context(request, context_reply(), executor(), RecordingTransceiver())
    assert request.output_token_ids == [11] and request.py_draft_tokens == [12, 13, 14]
    assert isinstance(load_kv, PromptKvPull) and load_kv.handle == handle()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"first_token": 100}, r"must be in \[0, 100\); got \[100\]"),
        ({"draft_tokens": [12, -1, 14]}, r"got \[-1\]"),
        (
            {"draft_tokens": [1, 2, 3, 4]},
            "has 4 tokens; this server verifies at most max_draft_len=3",
        ),
    ],
    ids=["first_token", "draft", "too_many_drafts"],
)
def test_bad_tokens_fail_the_request_before_it_joins_a_batch(change, message):
    # issue 11, item 8: an out-of-vocabulary token used to fail the whole batch in the forward
    request = LlmRequest(request_id=3, prompt_token_ids=[1, 2, 3], max_new_tokens=8)
    bad = trust.sign(context_reply().model_copy(update=change), SECRET)  # even a signed one
    with pytest.raises(ValueError, match=message):
        resume_from_context(request, bad, executor(), RecordingTransceiver())
    assert request.output_token_ids == []


def test_only_a_context_servers_handle_can_be_resumed():
    assert check_resumable(context_reply().for_generation()) == handle()
    finished = DisaggregatedParams(
        request_type=RequestType.FINISHED, output_token_ids=[2], finish_reason=FinishReason.STOP
    )
    with pytest.raises(ValueError, match="disaggregated_params.request_type='finished'"):
        check_resumable(finished)
    with pytest.raises(ValueError, match="request_type='context_only'"):
        check_resumable(DisaggregatedParams(request_type=RequestType.CONTEXT_ONLY))
    request = LlmRequest(request_id=3, prompt_token_ids=[1, 2], max_new_tokens=8)
    with pytest.raises(ValueError, match="request 3: its prompt is not"):
        resume_from_context(request, context_reply(), executor(), RecordingTransceiver())


def test_a_cold_prompt_is_pulled_whole_and_a_cached_prefix_is_not_pulled_again():
    ex, transceiver = executor(), RecordingTransceiver()
    manager = ex.kv_cache_manager
    cold = LlmRequest(request_id=0, prompt_token_ids=PROMPT, max_new_tokens=8)
    assert PromptKvPull(ex, transceiver, handle())(cold) == 300
    assert transceiver.pulls == [(0, 7, 0, 3, 5.0)]
    manager.commit_sequence(0, 300, PROMPT)  # what the executor does once the KV is final
    manager.free_sequence(0)
    warm = LlmRequest(request_id=1, prompt_token_ids=PROMPT, max_new_tokens=8)
    assert PromptKvPull(ex, transceiver, handle(request_id=8))(warm) == 300 - 256
    assert warm.num_reused_tokens == 256 and transceiver.pulls[1] == (1, 8, 2, 3, 5.0)
    assert len(manager.get_batch_cache_indices([1])[0]) == 3
    manager.check_integrity()


def test_an_incompatible_peer_is_refused_before_any_slot_is_taken():
    ex = executor()
    request = LlmRequest(request_id=0, prompt_token_ids=PROMPT, max_new_tokens=8)
    with pytest.raises(ValueError, match="incompatible KV cache layout on peer 'ctx'"):
        PromptKvPull(ex, RecordingTransceiver(refuse=True), handle())(request)
    assert ex.kv_cache_manager.get_kv_cache_stats().num_used_slots == 0


def test_the_config_and_the_pull_share_one_transfer_timeout_default():
    assert CacheTransceiverConfig().transfer_timeout_s == DEFAULT_TRANSFER_TIMEOUT_S
    for method in (KvCacheTransceiver.pull, KvCacheTransceiver.pull_steps):
        assert inspect.signature(method).parameters["timeout_s"].default == (
            DEFAULT_TRANSFER_TIMEOUT_S
        )


def test_tensor_parallel_ranks_agree_on_a_pull_and_only_rank_0_tells_the_context_server():
    # every rank pulls its heads; one rank's failure fails the request on all of them
    def ranks(other_error):  # each step's states: this rank's, and the other one's
        return lambda mine: [mine, other_error or mine]

    ex, leader = executor(), RecordingTransceiver()
    request = LlmRequest(request_id=0, prompt_token_ids=PROMPT, max_new_tokens=8)
    assert PromptKvPull(ex, leader, handle(), agree=ranks(None))(request) == 300
    assert leader.told == ["pulled"]  # once every rank has its part
    ex.kv_cache_manager.free_sequence(0)
    follower = RecordingTransceiver()
    late = {"error": "StaleTransferError: late", "replayed": False}
    pull = PromptKvPull(ex, follower, handle(), agree=ranks(late), leader=False)
    with pytest.raises(
        KvPullFailed, match="request 1: KV pull failed on rank 1: StaleTransferError"
    ):
        pull(LlmRequest(request_id=1, prompt_token_ids=PROMPT, max_new_tokens=8))
    pull.abandon()
    assert follower.told == []  # rank 0 releases the hold, not the followers
