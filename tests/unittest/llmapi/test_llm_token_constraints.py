"""vLLM's token constraints (issue 57, item 5): ``allowed_token_ids`` keeps every output token in
its set, a bad word never appears, a stop token ends the output where it is generated; applied
to the target's logits before acceptance, so Eagle3 decodes what target-only decoding does, and
the overlap scheduler's steps keep them too."""

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.executors.ranks import request_from_json, request_to_json
from tensorrt_llm._torch.pyexecutor.bad_words import BadWordState
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig
from tensorrt_llm.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParamsError

# prompts unlike the tiny model's training data: it is unsure of them, so a constraint changes
# what it writes
TEXTS = ["zq xv kk", "Tell me a story.", "aaaa bbbb"]


@pytest.fixture(scope="module")
def llms():
    """Target only (with the overlap scheduler, its default) and with Eagle3, and the prompts."""
    spec = Eagle3DecodingConfig(
        max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache="unified"
    )
    target, eagle = LLM(device="cpu"), LLM(device="cpu", speculative_config=spec)
    prompts = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in TEXTS
    ]
    yield target, eagle, prompts
    target.shutdown()
    eagle.shutdown()


@pytest.fixture(autouse=True)
def no_slot_held(request):
    yield
    if "llms" in request.fixturenames:
        for llm in request.getfixturevalue("llms")[:2]:
            assert llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0


def both(llms, prompts, params):
    """The outputs of the target and of Eagle3 (equal), and the target's overlapped steps."""
    target, eagle, _ = llms
    before = target.get_stats()["num_overlapped_steps"]
    plain = [o.outputs[0] for o in target.generate(prompts, params)]
    overlapped = target.get_stats()["num_overlapped_steps"] - before
    speculative = [o.outputs[0] for o in eagle.generate(prompts, params)]
    assert [o.token_ids for o in speculative] == [o.token_ids for o in plain]
    return plain, overlapped


@pytest.fixture(scope="module")
def unconstrained(llms):
    return both(llms, llms[2], SamplingParams(max_tokens=24))[0]


WORDS = [" mil", "win", "I"]  # a word each prompt's unconstrained output holds


@pytest.fixture(scope="module")
def constrained(llms, unconstrained):
    """Every prompt under each constraint, in one batch: (``allowed_token_ids``: the first six
    tokens of the unconstrained outputs; bad ``WORDS``; a stop token: the sixth of the first
    output), as ``{kind: (outputs per prompt, the constraint)}``, and the overlapped steps."""
    prompts = llms[2]
    kinds = {
        "allowed_token_ids": sorted({t for o in unconstrained for t in o.token_ids[:6]}),
        "bad": WORDS,
        "stop_token_ids": [unconstrained[0].token_ids[5]],
    }
    params = [SamplingParams(max_tokens=24, **{k: v}) for k, v in kinds.items() for _ in prompts]
    outs, overlapped = both(llms, prompts * len(kinds), params)
    n = len(prompts)
    return {k: (outs[i * n : (i + 1) * n], v) for i, (k, v) in enumerate(kinds.items())}, overlapped


def test_the_unconstrained_outputs_hold_what_the_constraints_take_away(unconstrained):
    assert all(word in out.text for word, out in zip(WORDS, unconstrained, strict=True))
    assert unconstrained[0].token_ids[5] not in unconstrained[0].token_ids[:5]


def test_constrained_steps_overlap(constrained):
    assert constrained[1] > 0


def test_allowed_token_ids_keep_every_token_in_the_set(unconstrained, constrained):
    outs, allowed = constrained[0]["allowed_token_ids"]
    for free, held in zip(unconstrained, outs, strict=True):
        assert set(held.token_ids) <= set(allowed) and len(held.token_ids) == 24
        assert not set(free.token_ids) <= set(allowed)


def test_bad_words_never_appear(llms, constrained):
    # "win" and "mil" are three tokens each (their last is banned after the other two), "I" one
    # (banned everywhere)
    outs, _ = constrained[0]["bad"]
    for word, held in zip(WORDS, outs, strict=True):
        assert word not in held.text
        ids = llms[0].tokenizer.encode(word.strip())
        tokens = held.token_ids
        assert all(tokens[i : i + len(ids)] != ids for i in range(len(tokens)))


def test_a_stop_token_ends_the_output_where_it_is_generated(llms, unconstrained, constrained):
    outs, (stop,) = constrained[0]["stop_token_ids"]
    for free, out in zip(unconstrained, outs, strict=True):
        tokens = free.token_ids
        if stop not in tokens:
            assert out.token_ids == tokens
            continue
        k = tokens.index(stop)
        assert out.token_ids == tokens[: k + 1] and out.finish_reason is FinishReason.STOP
        assert out.stop_reason == stop
        assert out.text == llms[0].tokenizer.decode(tokens[:k])  # (the stop token's text left out)
    assert outs[0].token_ids == unconstrained[0].token_ids[:6]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"stop_token_ids": [1] * 257}, "stop_token_ids"),
        ({"bad_token_ids": [1.5]}, "bad_token_ids"),
        ({"bad": ["ok", " "]}, "bad"),
        ({"bad": ["x"] * 129}, "bad"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(params, field):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**params)
    assert info.value.field == field


@pytest.mark.parametrize(
    "params, field",
    [
        ({"allowed_token_ids": [3, 136]}, "allowed_token_ids"),
        ({"stop_token_ids": [999]}, "stop_token_ids"),
        ({"bad_token_ids": [136]}, "bad_token_ids"),
        ({"bad": ["x" * (MAX_BAD_WORD_TOKENS + 1)]}, "bad"),
        ({"allowed_token_ids": [45, 7], "bad_token_ids": [7], "bad": ["m"]}, "allowed_token_ids"),
    ],
)
def test_constraints_the_model_cannot_keep_are_refused(llms, params, field):
    # the vocabulary is 136 tokens; "m" is token 45: the bans leave no allowed token
    target, _, prompts = llms
    assert target.model_config.vocab_size == 136 and target.tokenizer.encode("m") == [45]
    with pytest.raises(SamplingParamsError) as info:
        target.generate(prompts[0], SamplingParams(**params))
    assert info.value.field == field


def test_the_constraints_travel_to_the_engine_core():
    params = SamplingParams(allowed_token_ids=[1, 2, 3], bad=["ab"], stop_token_ids=[4])
    request = LlmRequest(1, [5, 6], 8, params, bad_word_ids=((7, 8), (9, 8), (3,)))
    again = request_from_json(request_to_json(request))
    assert again.sampling_params == params and again.bad_word_ids == ((7, 8), (9, 8), (3,))
    with pytest.raises(ValueError, match="bad_word_ids"):  # never a bad word silently dropped
        LlmRequest(2, [5], 8, SamplingParams(bad_token_ids=[3]))


def test_a_words_last_token_is_banned_on_each_verify_row_its_other_tokens_precede():
    state = BadWordState(2, torch.device("cpu"))  # slot 0, scratch slot 1
    state.fill(0, [(3, 4), (5, 6, 7), (2,)], output=[1, 3])
    logits = torch.zeros(4, 8)  # one group of 4 rows: the output, then drafts 4, 5, 6
    state.ban(logits, torch.tensor([0]), torch.tensor([[4, 5, 6]]))
    inf = float("-inf")
    assert logits.tolist() == [
        [0, 0, 0, 0, inf, 0, 0, 0],  # after [.., 3]: 4 of (3, 4)
        [0] * 8,  # after [.., 3, 4]
        [0] * 8,  # after [.., 4, 5]: (5, 6, 7) needs 6 first
        [0, 0, 0, 0, 0, 0, 0, inf],  # after [.., 5, 6]: 7
    ]
    # the step made 5 then 3 (one draft taken, then the target's own): the output ends 3 again
    state.record(torch.tensor([0]), torch.tensor([[5, 3, 0, 0]]), torch.tensor([2]))
    assert state.recent[0, -3:].tolist() == [3, 5, 3]
    logits = torch.zeros(1, 8)
    state.ban(logits, torch.tensor([0]), torch.zeros(1, 0, dtype=torch.long))
    assert logits[0].tolist() == [0, 0, 0, 0, inf, 0, 0, 0]
    logits = torch.zeros(1, 8)  # the scratch slot bans nothing
    state.ban(logits, torch.tensor([1]), torch.zeros(1, 0, dtype=torch.long))
    assert logits[0].tolist() == [0] * 8
