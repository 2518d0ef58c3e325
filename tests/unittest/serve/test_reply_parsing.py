"""A chat reply read by the server's parsers: ``message.reasoning_content`` and
``message.tool_calls`` whole, ``delta.reasoning_content`` and ``delta.tool_calls`` streamed,
however the steps cut the markers and the markup; without parsers the text is left as it is."""

import json
import random
from types import SimpleNamespace

import pytest

from tensorrt_llm.commands.serve import build_server
from tensorrt_llm.llmapi.reasoning_parser import ReasoningParserFactory
from tensorrt_llm.serve.choices import ChoiceStream, Renderer
from tensorrt_llm.serve.reply_parsing import ReplyParsing
from tensorrt_llm.serve.tool_parser import ToolParserFactory

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
    return Renderer(
        tokenizer=None, chat=True, parsing=None if parser is None else ReplyParsing(parser)
    )


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


NS = "]<]minimax[>["
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALLING = (
    "<mm:think>Use the tool.</mm:think>Adding."
    f'{NS}<tool_call>\n{NS}<invoke name="add">{NS}<a>2{NS}</a>{NS}<b>3{NS}</b>{NS}</invoke>\n'
    f'{NS}<invoke name="add">{NS}<a>4{NS}</a>{NS}<b>5{NS}</b>{NS}</invoke>\n{NS}</tool_call>'
)


def calling_renderer() -> Renderer:
    reasoning = ReasoningParserFactory.create_reasoning_parser("minimax_m3")
    parsing = ReplyParsing(
        reasoning, lambda: ToolParserFactory.create_tool_parser("minimax_m3"), TOOLS
    )
    return Renderer(tokenizer=None, chat=True, parsing=parsing)


def test_a_reply_that_calls_tools_whole():
    choice = calling_renderer().whole(snapshot(CALLING, finished=True), 0)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert (message["reasoning_content"], message["content"]) == ("Use the tool.", "Adding.")
    calls = message["tool_calls"]
    assert [
        (c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ] == [
        ("function", "add", {"a": 2, "b": 3}),
        ("function", "add", {"a": 4, "b": 5}),
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call") for c in calls)
    # only tools: no content; cut by the token limit: the reason stays
    only = calling_renderer().whole(snapshot(CALLING[CALLING.index(NS) :], finished=True), 0)
    assert only["message"]["content"] is None
    cut = snapshot(CALLING, finished=True)
    cut.outputs[0].finish_reason = "length"
    assert calling_renderer().whole(cut, 0)["finish_reason"] == "length"


@pytest.mark.parametrize("seed", range(6))
def test_a_streamed_reply_that_calls_tools_joins_to_the_whole_one(seed):
    whole = calling_renderer().whole(snapshot(CALLING, finished=True), 0)["message"]
    deltas = streamed(calling_renderer(), CALLING, random.Random(seed))
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert "".join(d["delta"].get("content", "") for d in deltas) == whole["content"]
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "Use the tool."
    calls: dict[int, dict] = {}
    for entry in (e for d in deltas for e in d["delta"].get("tool_calls", [])):
        if "id" in entry:  # a call's first entry: its id, type and name
            assert entry["index"] not in calls and entry["type"] == "function"
            calls[entry["index"]] = {"name": entry["function"]["name"], "arguments": ""}
        calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in whole["tool_calls"]
    ]
    assert not any(NS in str(d) for d in deltas)


def test_a_context_server_without_a_tool_parser_takes_a_context_only_request_with_tools():
    # (its reply is the first token; the generation server reads the rest for calls)
    from tensorrt_llm.serve.chat_protocol import ChatProtocol
    from tensorrt_llm.serve.errors import ServerError
    from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest

    protocol = ChatProtocol(prompt_ending(""), "minimax_m3", None)
    fields = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    context_only = ChatCompletionRequest(
        **fields, disaggregated_params={"request_type": "context_only"}
    )
    parsing = protocol.parsing(context_only, [1, 2])
    assert parsing.tool_parser is None and parsing.reasoning is not None
    with pytest.raises(ServerError, match="--tool_parser"):
        protocol.parsing(ChatCompletionRequest(**fields), [1, 2])


def prompt_ending(text: str):
    """A stand-in tokenizer whose prompts decode to ``text`` at their end."""
    return SimpleNamespace(decode=lambda ids, skip_special_tokens: text)


@pytest.mark.parametrize(
    ("end", "mode"),
    [
        ("]~b]ai\n<mm:think>", "enabled"),
        ("]~b]ai\n</mm:think>", "disabled"),
        ("]~b]ai\n", "adaptive"),
        ("<|assistant|>", "adaptive"),  # a template that ignores thinking_mode opens no block
    ],
)
def test_where_the_reply_starts_is_read_from_the_rendered_prompt(end, mode):
    from tensorrt_llm.serve.chat_protocol import ChatProtocol
    from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest

    protocol = ChatProtocol(prompt_ending(end), "minimax_m3", None)
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], reasoning_effort="high"
    )
    parsing = protocol.parsing(body, {"prompt_token_ids": [1, 2, 3]})
    assert parsing.reasoning.thinking_mode == mode


def deltas_cut_at(render: Renderer, text: str, cuts, reason: str) -> list[dict]:
    """The deltas of ``text`` arriving in steps that end at ``cuts``, finished with ``reason``."""
    stream, deltas = ChoiceStream(render, 0, None), []
    for i in sorted({c for c in cuts if 0 < c < len(text)} | {len(text)}):
        snap = snapshot(text[:i], finished=i == len(text))
        if i == len(text):
            snap.outputs[0].finish_reason = reason
        choice = stream.chunk(snap)
        if choice is not None:
            deltas.append(choice)
    return deltas


def read_message(message: dict, finish_reason) -> tuple:
    """What a reply says, whole or joined from its deltas: reasoning, content, calls, reason."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    return (message["reasoning_content"] or "", message["content"] or "", calls, finish_reason)


def joined_message(deltas: list[dict]) -> tuple:
    calls: dict[int, dict] = {}
    for entry in (e for d in deltas for e in d["delta"].get("tool_calls", [])):
        if "id" in entry:
            assert entry["index"] not in calls
            calls[entry["index"]] = {"function": {"name": entry["function"]["name"]}}
            calls[entry["index"]]["function"]["arguments"] = ""
        calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    message = {
        "reasoning_content": "".join(d["delta"].get("reasoning_content", "") for d in deltas),
        "content": "".join(d["delta"].get("content", "") for d in deltas),
        "tool_calls": [calls[i] for i in sorted(calls)],
    }
    return read_message(message, deltas[-1]["finish_reason"])


STRAY = f"{NS}</invoke>"
OPEN_CALL = f'{NS}<invoke name="add">{NS}<a>7{NS}</a>'


@pytest.mark.parametrize(
    ("text", "reason", "content", "num_calls"),
    [
        (CALLING, "stop", "Adding.", 2),
        (  # a stray closing tag after a call: the call stands, the marker stays in the content
            CALLING.replace(f"{NS}</invoke>\n{NS}<invoke", f"{NS}</invoke>{STRAY}{NS}<invoke"),
            "stop",
            "Adding." + CALLING[CALLING.index(STRAY) + len(STRAY) :].replace("\n", STRAY, 1),
            1,
        ),
        (  # cut by the token limit inside a call: that call is content, the one before stands
            CALLING[: CALLING.index(f'\n{NS}<invoke name="add">{NS}<a>4')] + "\n" + OPEN_CALL,
            "length",
            "Adding." + OPEN_CALL,
            1,
        ),
        (f"<mm:think>x</mm:think>{OPEN_CALL}{STRAY}", "stop", f"{OPEN_CALL}{STRAY}", 0),
        (f"<mm:think>x</mm:think>a{NS}<tool_call>\n{OPEN_CALL}", "length", None, 0),
    ],
)
def test_a_streamed_reply_reads_as_the_whole_one_wherever_the_steps_cut_it(
    text, reason, content, num_calls
):
    """Cut at every point, the deltas join to the whole reply's message: no call goes out that
    the whole reading does not have, and a marker that opens or closes nothing stays content."""
    snap = snapshot(text, finished=True)
    snap.outputs[0].finish_reason = reason
    choice = calling_renderer().whole(snap, 0)
    message = {"tool_calls": [], **choice["message"]}
    expected = read_message(message, choice["finish_reason"])
    assert len(expected[2]) == num_calls
    assert expected[1] == (
        content if content is not None else text[len("<mm:think>x</mm:think>") :]
    )
    for i in range(len(text) + 1):
        assert joined_message(deltas_cut_at(calling_renderer(), text, [i], reason)) == expected, i
    one_by_one = deltas_cut_at(calling_renderer(), text, range(len(text)), reason)
    assert joined_message(one_by_one) == expected
