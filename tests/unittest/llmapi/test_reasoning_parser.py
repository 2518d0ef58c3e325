"""MiniMax-M3's reasoning parser: each thinking mode's vectors whole, then streamed in random
pieces (markers cut anywhere), which must give the same split with no marker in either field."""

import random
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorrt_llm.llmapi.reasoning_parser import (
    MiniMaxM3ReasoningParser,
    ReasoningParserFactory,
    ReasoningParserResult,
)

START, END = "<mm:think>", "</mm:think>"

# (thinking_mode, output, reasoning_content, content)
VECTORS = [
    # adaptive: a block the model opens, a bare end marker (no reasoning), or an answer at once
    ("adaptive", f"{START}Add 2 and 3.{END}The sum is 5.", "Add 2 and 3.", "The sum is 5."),
    ("adaptive", f"{END}The sum is 5.", "", "The sum is 5."),
    ("adaptive", "The sum is 5.", "", "The sum is 5."),
    ("adaptive", f"\n  {START}r{END}\n\na", "r", "\n\na"),
    ("adaptive", f"{START}never closed", "never closed", ""),
    ("adaptive", "", "", ""),
    ("adaptive", "  ", "", "  "),
    ("adaptive", "<mm:thinking is not a marker", "", "<mm:thinking is not a marker"),
    ("adaptive", "a < b and c </ d", "", "a < b and c </ d"),
    # enabled: the prompt opened the block
    ("enabled", f"First add.{END}5", "First add.", "5"),
    ("enabled", f"{START}First add.{END}5", "First add.", "5"),  # written again: dropped
    ("enabled", "cut off by the token limit", "cut off by the token limit", ""),
    ("enabled", f"\nstep 1\n{END}\nanswer", "\nstep 1\n", "\nanswer"),
    # disabled: the prompt closed it; a block the model still opens at the start is reasoning
    ("disabled", "The sum is 5.", "", "The sum is 5."),
    ("disabled", f"{START}r{END}a", "r", "a"),
    # a marker anywhere else is dropped, the text around it kept
    ("adaptive", f"{START}a{START}b{END}c{END}d{START}e", "ab", "cde"),
    ("adaptive", f"x{END}y", "", "xy"),
    ("enabled", f"r{END}a{END}b", "r", "ab"),
]


def streamed(parser, text: str, rng: random.Random) -> ReasoningParserResult:
    """``text`` through ``parse_delta`` in random pieces (1 to 7 characters), then ``finish``;
    the pieces' results concatenated."""
    out = ReasoningParserResult()
    i = 0
    while i < len(text):
        size = rng.randint(1, 7)
        part = parser.parse_delta(text[i : i + size])
        out.content += part.content
        out.reasoning_content += part.reasoning_content
        i += size
    last = parser.finish()
    return ReasoningParserResult(
        out.content + last.content, out.reasoning_content + last.reasoning_content
    )


@pytest.mark.parametrize(("mode", "text", "reasoning", "content"), VECTORS)
def test_vectors_whole_and_streamed_in_random_pieces(mode, text, reasoning, content):
    parser = ReasoningParserFactory.create_reasoning_parser("minimax_m3", {"thinking_mode": mode})
    assert parser.parse(text) == ReasoningParserResult(content, reasoning)
    rng = random.Random(zlib.crc32(f"{mode}{text}".encode()))
    for _ in range(20):
        fresh = parser.fresh()
        assert streamed(fresh, text, rng) == ReasoningParserResult(content, reasoning)
    # one character at a time: every marker is cut at every place
    one = parser.fresh()
    pieces = [one.parse_delta(c) for c in text] + [one.finish()]
    assert "".join(p.reasoning_content for p in pieces) == reasoning
    assert "".join(p.content for p in pieces) == content


def test_a_marker_is_held_back_until_it_can_no_longer_be_one():
    parser = MiniMaxM3ReasoningParser("enabled")
    assert parser.parse_delta("think </mm:th") == ReasoningParserResult("", "think ")
    assert parser.parse_delta("ink>ans") == ReasoningParserResult("ans", "")
    assert parser.parse_delta("wer </m") == ReasoningParserResult("wer ", "")
    assert parser.parse_delta("y") == ReasoningParserResult("</my", "")
    assert parser.finish() == ReasoningParserResult("", "")


def test_the_start_waits_for_text_that_is_not_a_marker():
    parser = MiniMaxM3ReasoningParser("adaptive")
    assert parser.parse_delta("\n<mm") == ReasoningParserResult()  # still maybe a marker
    assert parser.parse_delta(":think>") == ReasoningParserResult()
    assert parser.parse_delta("r") == ReasoningParserResult("", "r")
    held = MiniMaxM3ReasoningParser("adaptive")
    assert held.parse_delta("<") == ReasoningParserResult()
    assert held.finish() == ReasoningParserResult("<", "")  # (it never became one)


def test_the_default_mode_is_adaptive_and_unknown_names_are_refused():
    parser = ReasoningParserFactory.create_reasoning_parser("minimax_m3")
    assert parser.thinking_mode == "adaptive"
    with pytest.raises(ValueError, match="'qwen3'.*minimax_m3"):
        ReasoningParserFactory.create_reasoning_parser("qwen3")
    with pytest.raises(ValueError, match="thinking_mode='sometimes'"):
        ReasoningParserFactory.create_reasoning_parser("minimax_m3", {"thinking_mode": "sometimes"})


FRAGMENTS = st.sampled_from([START, END, "<", "</", "<mm:", "think>", "mm", " ", "\n", "ab", "5"])


@given(
    mode=st.sampled_from(["enabled", "disabled", "adaptive"]),
    text=st.lists(FRAGMENTS, max_size=12).map("".join),
    seed=st.integers(0, 2**16),
)
def test_any_split_of_any_output_gives_the_whole_outputs_result(mode, text, seed):
    parser = MiniMaxM3ReasoningParser(mode)
    whole = parser.parse(text)
    assert streamed(parser.fresh(), text, random.Random(seed)) == whole
    # nothing is lost but markers: the two fields hold every other character, in order
    assert len(whole.content) + len(whole.reasoning_content) <= len(text)


def test_the_mode_is_read_from_where_the_prompt_leaves_the_model():
    create = ReasoningParserFactory.create_reasoning_parser
    assert create("minimax_m3", prompt="]~b]ai\n<mm:think>").thinking_mode == "enabled"
    assert create("minimax_m3", prompt="]~b]ai\n</mm:think>\n").thinking_mode == "disabled"
    # the prompt wins over what the request asked: this template opened no block
    asked = {"thinking_mode": "enabled"}
    assert create("minimax_m3", asked, prompt="<|assistant|>").thinking_mode == "adaptive"
