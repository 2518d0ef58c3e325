"""Relaxed acceptance in the thinking phase (``use_relaxed_acceptance_for_thinking``): inside a
``<mm:think>`` block a greedy row accepts a draft among the target's top tokens, outside it (and
for the markers) exactly; the phase follows the tokens on the device."""

import sys
from pathlib import Path

import pytest
import torch

from tensorrt_llm import LLM, MTPDecodingConfig, SamplingParams
from tensorrt_llm._torch.speculative.interface import RelaxedAcceptance
from tensorrt_llm._torch.speculative.relaxed import ThinkingPhases, thinking_after, with_markers
from tensorrt_llm.tokenizer import M3_TEXT_TOKENS, build_char_tokenizer

sys.path.insert(0, str(Path(__file__).parents[2] / "llmapi"))
from llm_helpers import ALPHABET, SPECIALS, write_tiny_checkpoint  # noqa: E402

BEGIN, END = 7, 8
VOCAB = 10


def _logits(rows: list[list[list[float]]]) -> torch.Tensor:
    """Logits whose softmax is (about) the given probabilities, ``[n, T, V]``."""
    return torch.tensor(rows).clamp(min=1e-9).log()


def _dist(**probs: float) -> list[float]:
    """A distribution over ``VOCAB`` ids from ``id=p`` pairs (``t3=0.6``), the rest spread evenly."""
    out = [0.0] * VOCAB
    for name, p in probs.items():
        out[int(name[1:])] = p
    rest = (1.0 - sum(out)) / (VOCAB - len(probs))
    return [p if p else rest for p in out]


def _phases(topk: int, delta: float, thinking: list[bool]) -> tuple[ThinkingPhases, torch.Tensor]:
    phases = ThinkingPhases(RelaxedAcceptance(topk, delta, BEGIN, END), 8, torch.device("cpu"))
    slots = torch.arange(len(thinking))
    phases.phase[slots] = torch.tensor(thinking)
    return phases, slots


def test_thinking_rows_accept_a_close_second_choice_and_others_only_the_top_one():
    # each position: the top token 1 (0.5), then 2 (0.4); drafts are the second choice 2
    logits = _logits([[_dist(t1=0.5, t2=0.4)] * 4] * 2)
    drafts = torch.tensor([[2, 2, 2]] * 2)
    valid = torch.ones(2, 3, dtype=torch.bool)
    phases, slots = _phases(topk=2, delta=0.2, thinking=[True, False])
    tokens, accepted = phases.accept(logits, drafts, valid, slots)
    assert accepted.tolist() == [3, 0]
    assert tokens[0].tolist() == [2, 2, 2, 1]  # the drafts, then the target's own token
    assert tokens[1, 0] == 1  # outside the block: the target's own token at once
    # a token the logits rule out (a grammar's mask) is refused however loose the bounds
    masked = logits.clone()
    masked[..., 2] = float("-inf")
    phases, slots = _phases(topk=VOCAB, delta=1.0, thinking=[True])
    assert phases.accept(masked[:1], drafts[:1], valid[:1], slots)[1].tolist() == [0]
    # a second choice further than delta from the top one, or past topk, is refused
    for topk, delta in ((2, 0.05), (1, 0.2)):
        phases, slots = _phases(topk, delta, thinking=[True])
        assert phases.accept(logits[:1], drafts[:1], valid[:1], slots)[1].tolist() == [0]


def test_topk_1_and_delta_0_accept_exactly_as_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 4, VOCAB)
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(6, 3) < 0.6, argmax[:, :3], torch.randint(0, VOCAB, (6, 3)))
    valid = torch.ones(6, 3, dtype=torch.bool)
    phases, slots = _phases(1, 0.0, thinking=[True, False] * 3)
    tokens, accepted = phases.accept(logits, drafts, valid, slots)
    match = (drafts == argmax[:, :3]).int().cumprod(1).sum(1)
    assert accepted.tolist() == match.tolist()
    for row, n in enumerate(accepted.tolist()):
        assert tokens[row, : n + 1].tolist() == argmax[row, : n + 1].tolist()


def test_the_phase_follows_the_markers_among_drafts_and_new_tokens():
    valid = torch.ones(1, 3, dtype=torch.bool)
    # the block ends with the first draft (accepted: it is the top token), so the second choice
    # after it is refused
    end_first = _logits([[_dist(t8=0.9), *[_dist(t1=0.5, t2=0.4)] * 3]])
    phases, slots = _phases(2, 0.2, thinking=[True])
    tokens, accepted = phases.accept(end_first, torch.tensor([[END, 2, 2]]), valid, slots)
    assert accepted.tolist() == [1] and tokens[0, :2].tolist() == [END, 1]
    phases.advance(slots, tokens, accepted)
    assert phases.phase[0].item() is False
    # a marker is never accepted relaxed: the end marker as a close second choice is refused
    phases, slots = _phases(2, 0.2, thinking=[True])
    near_end = _logits([[_dist(t1=0.5, t8=0.4)] * 4])
    assert phases.accept(near_end, torch.tensor([[END, 2, 2]]), valid, slots)[1].tolist() == [0]
    # a block opened by an accepted draft relaxes the drafts after it
    opens = _logits([[_dist(t7=0.9), *[_dist(t1=0.5, t2=0.4)] * 3]])
    phases, slots = _phases(2, 0.2, thinking=[False])
    tokens, accepted = phases.accept(opens, torch.tensor([[BEGIN, 2, 2]]), valid, slots)
    assert accepted.tolist() == [3]
    phases.advance(slots, tokens, accepted)
    assert phases.phase[0].item() is True
    # only the new tokens move the phase: an end marker past the accepted ones does not
    phases, slots = _phases(2, 0.2, thinking=[True])
    phases.advance(slots, torch.tensor([[3, 4, END, 5]]), torch.tensor([1]))
    assert phases.phase[0].item() is True


def test_the_phase_of_a_new_request_is_its_tokens_last_marker():
    assert thinking_after([1, BEGIN, 3], BEGIN, END)
    assert not thinking_after([BEGIN, 3, END, 4], BEGIN, END)
    assert not thinking_after([1, 2], BEGIN, END)
    phases = ThinkingPhases(RelaxedAcceptance(1, 0.0, BEGIN, END), 4, torch.device("cpu"))
    phases.start([2, 0], [[BEGIN, 1], [END]])
    assert phases.phase.tolist() == [False, False, True, False, False]


def test_markers_come_from_the_tokenizer_or_an_error_names_the_option():
    from tensorrt_llm.tokenizer import TransformersTokenizer

    tok = build_char_tokenizer(ALPHABET, SPECIALS, text_tokens=M3_TEXT_TOKENS)
    resolved = with_markers(RelaxedAcceptance(), TransformersTokenizer(tok))
    assert (resolved.begin, resolved.end) == (tok.token_to_id("<mm:think>"), 3)
    plain = TransformersTokenizer(build_char_tokenizer(ALPHABET, SPECIALS))
    with pytest.raises(ValueError, match="begin_thinking_phase_token"):
        with_markers(RelaxedAcceptance(), plain)
    assert with_markers(RelaxedAcceptance(begin=5, end=6), None).begin == 5


@pytest.fixture(scope="module")
def m3_mtp(tmp_path_factory) -> Path:
    tokenizer = build_char_tokenizer(ALPHABET, SPECIALS, text_tokens=M3_TEXT_TOKENS)
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("relaxed"), seed=5, tokenizer=tokenizer, num_mtp_modules=1
    )


def test_through_llm_relaxed_thinking_accepts_more_and_leaves_the_answer_exact(m3_mtp):
    """A random module's drafts: exact acceptance takes few; accepting any draft in the block
    (``relaxed_topk`` = the vocabulary, ``relaxed_delta`` = 1) takes every one until the block
    ends, and what follows ``</mm:think>`` is the target's own greedy continuation. Prompts
    without an open block, and ``topk=1, delta=0``, give the target-only tokens."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["<mm:think>abc", "hello <mm:think>", "abc abc", "<mm:think>x</mm:think>hello"]
    end = 3  # "</mm:think>"

    def run(prompts, params, spec=None):
        llm = LLM(model=str(m3_mtp), device="cpu", speculative_config=spec)
        try:
            return llm.generate(prompts, params)
        finally:
            llm.shutdown()

    def mtp(**relaxed):
        return run(prompts, params, MTPDecodingConfig(max_draft_len=3, **relaxed))

    exact = mtp()
    same = mtp(use_relaxed_acceptance_for_thinking=True)
    loose = mtp(use_relaxed_acceptance_for_thinking=True, relaxed_topk=10**6, relaxed_delta=1.0)
    ids = [[o.outputs[0].token_ids for o in outs] for outs in (exact, same, loose)]
    assert ids[1] == ids[0]
    assert ids[2][2:] == ids[0][2:]  # no open block: exact
    assert max(o.outputs[0].avg_decoded_tokens_per_iter for o in exact[:2]) < 2.0
    inside = [out for out in loose[:2] if end not in out.outputs[0].token_ids]
    assert inside and ids[2][:2] != ids[0][:2]
    for out in inside:  # the whole reply inside the block: every draft taken
        assert out.outputs[0].avg_decoded_tokens_per_iter == pytest.approx(23 / 6)
    for out in loose[:2]:
        got = out.outputs[0].token_ids
        if end in got:  # after the block: the target's own tokens
            cut = got.index(end) + 1
            rest = SamplingParams(max_tokens=24 - cut, temperature=0, ignore_eos=True)
            (want,) = run([out.prompt_token_ids + got[:cut]], rest)
            assert got[cut:] == want.outputs[0].token_ids
