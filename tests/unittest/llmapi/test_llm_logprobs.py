"""Log-probabilities of the emitted tokens (issue 12, item 2): under the target's distribution,
so the same with and without speculative decoding; a greedy token's is the largest of its top."""

import math
import random

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig


@pytest.fixture(scope="module")
def outputs():
    target = LLM(device="cpu")
    eagle = LLM(
        device="cpu",
        speculative_config=Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache="unified"
        ),
    )
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
