"""A chat reply with a reasoning parser: ``message.reasoning_content`` whole, and
``delta.reasoning_content`` streamed, however the steps cut the markers; without a parser the
text is left as it is."""

import random
from types import SimpleNamespace

import pytest

from tensorrt_llm.commands.serve import build_server
from tensorrt_llm.llmapi.reasoning_parser import ReasoningParserFactory
from tensorrt_llm.serve.choices import ChoiceStream, Renderer

TEXT = "<mm:think>2 and 3 make 5.</mm:think>The answer is 5."


def snapshot(text: str, finished: bool):
    """What a step's output gives the stream (the fields it reads)."""
    out = SimpleNamespace(
        text=text,
        num_tokens=len(text),
        finish_reason="stop" if finished else None,
        logprobs=None,
        avg_decoded_tokens_per_iter=1.0,
    )
    return SimpleNamespace(outputs=[out], finished=finished)


def renderer(mode: str | None = "adaptive") -> Renderer:
    parser = (
        None
        if mode is None
        else ReasoningParserFactory.create_reasoning_parser("minimax_m3", {"thinking_mode": mode})
    )
    return Renderer(tokenizer=None, chat=True, reasoning_parser=parser)


def streamed(render: Renderer, text: str, rng: random.Random) -> list[dict]:
    """The deltas of ``text`` arriving over steps of 1 to 6 characters."""
    stream, deltas, i = ChoiceStream(render, 0, None), [], 0
    while True:
        i = min(len(text), i + rng.randint(1, 6))
        choice = stream.chunk(snapshot(text[:i], finished=i == len(text)))
        if choice is not None:
            deltas.append(choice)
        if i == len(text):
            return deltas


@pytest.mark.parametrize("seed", range(8))
def test_streamed_reasoning_and_content_join_to_the_whole_replys(seed):
    render = renderer()
    whole = render.whole(snapshot(TEXT, finished=True), 0)["message"]
    assert whole == {
        "role": "assistant",
        "content": "The answer is 5.",
        "reasoning_content": "2 and 3 make 5.",
    }
    deltas = streamed(render, TEXT, random.Random(seed))
    assert deltas[0]["delta"]["role"] == "assistant"
    assert deltas[-1]["finish_reason"] == "stop"
    reasoning = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    content = "".join(d["delta"].get("content", "") for d in deltas)
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert not any("mm:think" in str(d["delta"]) for d in deltas)


def test_the_prompts_thinking_mode_decides_where_the_reply_starts():
    render = renderer("enabled")  # (the prompt opened the block)
    reply = render.whole(snapshot("add them</mm:think>5", finished=True), 0)["message"]
    assert (reply["reasoning_content"], reply["content"]) == ("add them", "5")
    no_reasoning = renderer("adaptive").whole(snapshot("5", finished=True), 0)["message"]
    assert no_reasoning == {"role": "assistant", "content": "5", "reasoning_content": None}


def test_without_a_parser_the_markers_stay_in_the_content():
    render = renderer(None)
    assert render.whole(snapshot(TEXT, finished=True), 0)["message"] == {
        "role": "assistant",
        "content": TEXT,
    }
    deltas = streamed(render, TEXT, random.Random(0))
    assert "".join(d["delta"].get("content", "") for d in deltas) == TEXT


def test_an_unknown_reasoning_parser_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="--reasoning_parser deepseek: expected one of"):
        build_server(None, None, device="cpu", reasoning_parser="deepseek")
