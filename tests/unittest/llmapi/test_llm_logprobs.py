"""Log-probabilities of the emitted tokens (issue 12, item 2): under the target's distribution,
so the same with and without speculative decoding; a greedy token's is the largest of its top."""

import math
import random

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig


def llm_pair(device: str) -> tuple[LLM, LLM]:
    """Target only, and with Eagle3 and the unified draft cache, on ``device``."""
    spec = Eagle3DecodingConfig(
        max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache="unified"
    )
    return LLM(device=device), LLM(device=device, speculative_config=spec)


@pytest.fixture(scope="module")
def target_and_eagle():
    return llm_pair("cpu")


@pytest.fixture(scope="module")
def outputs(target_and_eagle):
    target, eagle = target_and_eagle
    rng = random.Random(2)
    prompts = [target.tokenizer.apply_chat_template(gsm8k_tiny(rng)[0][:1]) for _ in range(3)]
    params = SamplingParams(max_tokens=24, logprobs=3)
    return [[o.outputs[0] for o in llm.generate(prompts, params)] for llm in (target, eagle)]


def test_a_greedy_tokens_logprob_is_the_largest_of_its_top(outputs):
    for out in outputs[0] + outputs[1]:
        assert len(out.logprobs) == len(out.token_ids)
        for token, (logprob, top) in zip(out.token_ids, out.logprobs, strict=True):
            assert len(top) == 3 and top[0] == (token, pytest.approx(logprob, abs=1e-6))
            assert logprob <= 0 and all(lp <= logprob + 1e-6 for _, lp in top)
            assert sum(math.exp(lp) for _, lp in top) <= 1 + 1e-5


def test_logprobs_are_the_targets_with_or_without_speculation(outputs):
    target, eagle = outputs
    assert sum(o.avg_decoded_tokens_per_iter for o in eagle) / len(eagle) > 1.5  # drafts accepted
    for plain, speculative in zip(target, eagle, strict=True):
        assert plain.token_ids == speculative.token_ids
        for (a, top_a), (b, top_b) in zip(plain.logprobs, speculative.logprobs, strict=True):
            assert a == pytest.approx(b, abs=2e-4)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"logprobs=21: must be an int in \[0, 20\]"):
        SamplingParams(logprobs=21)


@pytest.fixture(scope="module")
def llms(target_and_eagle):
    target, eagle = target_and_eagle
    # prompts unlike its training data: the tiny model is less sure of them, so a penalty of at
    # most 2 changes what it says (on gsm8k questions its logit margins are over 10)
    texts = ["zq xv kk", "Tell me a story.", "aaaa bbbb"]
    prompts = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts
    ]
    return target, eagle, prompts


def tokens(llm, prompts, **params):
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, **params))
    return [o.outputs[0].token_ids for o in outputs]


def test_penalties_change_the_output_and_speculation_keeps_it(llms):
    # issue 12, item 2: the penalties apply before speculative acceptance, counting the drafts
    # before each verify position, so Eagle3 decodes exactly what plain decoding does
    target, eagle, prompts = llms
    plain = tokens(target, prompts)
    for penalties in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = tokens(target, prompts, **penalties)
        assert penalized != plain
        assert tokens(eagle, prompts, **penalties) == penalized


def test_a_logit_bias_forces_a_token(llms):
    target, eagle, prompts = llms
    forced = target.tokenizer.encode("7")[0]
    for llm in (target, eagle):
        assert tokens(llm, prompts, logit_bias={forced: 100.0}) == [[forced] * 24] * 3


@pytest.mark.parametrize(
    "params, message",
    [
        ({"presence_penalty": 3}, "presence_penalty=3: must be a number in"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias=.*must map token ids"),
        ({"logit_bias": {5: 101}}, "logit_bias=.*to numbers in"),
    ],
)
def test_bad_penalties_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_each_verify_row_counts_the_drafts_before_it():
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
    from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
    from tensorrt_llm._torch.pyexecutor.seq_slot_manager import SeqSlotManager
    from tensorrt_llm._torch.pyexecutor.step_inputs import (
        RowLayout,
        StepInputs,
        row_values,
        row_views,
    )
    from tensorrt_llm._torch.pyexecutor.step_program import step_penalty_rows

    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={0: 2.0})
    req = LlmRequest(request_id=1, prompt_token_ids=[9], max_new_tokens=8, sampling_params=params)
    req.state, req.output_token_ids, req.py_draft_tokens = (
        LlmRequestState.GENERATION_IN_PROGRESS,
        [1, 2],
        [3, 3],
    )
    logits = torch.zeros(3, 5)
    seq_slots = SeqSlotManager(2)
    seq_slots.admit(req)
    state, layout = LogitsState(seq_slots, 5, torch.device("cpu")), RowLayout(penalties=True)
    ints, floats = row_values([req], 0, layout, state, None)
    _, _, penalties = row_views(torch.tensor(ints), torch.tensor(floats), 1, layout)
    drafts = torch.tensor([req.py_draft_tokens])
    inputs = StepInputs(torch.zeros(0), drafts, torch.tensor([2]), [0], penalties=penalties)
    state.adjust(logits, step_penalty_rows(inputs))
    assert logits.tolist() == [
        [2.0, -1.5, -1.5, 0.0, 0.0],  # after the output [1, 2]
        [2.0, -1.5, -1.5, -1.5, 0.0],  # and the first draft
        [2.0, -1.5, -1.5, -2.5, 0.0],  # and both: token 3 twice
    ]


@pytest.mark.gpu
def test_penalties_bias_and_logprobs_on_gpu():
    # on CUDA (graphs on): requests with penalties run eagerly and still decode losslessly
    target, eagle = llm_pair("cuda")
    texts = ["zq xv kk", "Tell me a story.", "aaaa bbbb"]
    prompts = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts
    ]
    forced = target.tokenizer.encode("7")[0]
    plain = tokens(target, prompts)
    for params in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = tokens(target, prompts, **params)
        assert penalized != plain and tokens(eagle, prompts, **params) == penalized
    for llm in (target, eagle):
        assert tokens(llm, prompts, logit_bias={forced: 100.0}) == [[forced] * 24] * 3
        out = llm.generate(prompts[0], SamplingParams(max_tokens=8, logprobs=2)).outputs[0]
        assert all(
            top[0] == (t, pytest.approx(lp, abs=1e-6))
            for t, (lp, top) in zip(out.token_ids, out.logprobs)
        )
