"""MiniMax-M3's chat template (``examples/templates/minimax_m3.jinja``, written from the published
format): its turns, the generation prompt of each thinking mode, tools in the developer turn, and
past tool calls in the markup the tool parser reads back to the same arguments."""

import json
from pathlib import Path

import pytest

from tensorrt_llm.bundled import BUNDLED_TARGET
from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest
from tensorrt_llm.serve.tool_parser import MiniMaxM3ToolParser
from tensorrt_llm.tokenizer import TransformersTokenizer, render_chat_template

TEMPLATE_FILE = Path(__file__).resolve().parents[3] / "examples/templates/minimax_m3.jinja"
TEMPLATE = TEMPLATE_FILE.read_text()
NS = "]<]minimax[>["
SYSTEM = (
    "]~!b[]~b]system\nYou are MiniMax-M3, a helpful assistant.\n<thinking_instructions>\n"
    "Reason inside <mm:think></mm:think> before the answer when reasoning helps.\n{line}\n"
    "</thinking_instructions>[e~[\n"
)
LINES = {
    "enabled": "Always reason before you answer.",
    "disabled": "Answer directly, without reasoning.",
    "adaptive": "Reason when the request needs it; otherwise answer directly.",
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}


@pytest.mark.parametrize(
    ("mode", "prompt_end"),
    [("enabled", "<mm:think>"), ("disabled", "</mm:think>"), ("adaptive", "")],
)
def test_each_thinking_mode_has_its_line_and_its_generation_prompt(mode, prompt_end):
    text = render_chat_template(
        TEMPLATE, [{"role": "user", "content": "Hi"}], True, thinking_mode=mode
    )
    assert text == SYSTEM.format(line=LINES[mode]) + "]~b]user\nHi[e~[\n]~b]ai\n" + prompt_end


def test_a_tool_round_trip_renders_in_the_published_turns():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use add.",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "done"},
        {"role": "assistant", "content": "5", "reasoning_content": "It said 5."},
    ]
    text = render_chat_template(TEMPLATE, messages, False, tools=[ADD])
    developer = (
        "]~b]developer\nBe brief.\n# Tools\nYou may call these tools:\n<tools>\n"
        f"<tool>{json.dumps(ADD['function'])}</tool>\n</tools>\n"
    )
    assert text.startswith(SYSTEM.format(line=LINES["adaptive"]) + developer)
    call = (
        f'{NS}<tool_call>\n{NS}<invoke name="add">{NS}<a>2{NS}</a>{NS}<b>3{NS}</b>{NS}</invoke>\n'
        f"{NS}</tool_call>"
    )
    assert text.endswith(
        "[e~[\n]~b]user\nWhat is 2 + 3?[e~[\n"
        f"]~b]ai\n<mm:think>Use add.</mm:think>{call}[e~[\n"  # (reasoning kept: interleaved)
        "]~b]tool\n<response>5</response>\n<response>done</response>[e~[\n"  # (one tool turn)
        "]~b]ai\n<mm:think>It said 5.</mm:think>5[e~[\n"
    )


@pytest.mark.parametrize(
    "arguments",
    [
        {"a": 2, "b": 3},
        {"city": "Paris", "days": [1, 2, 3], "metric": True, "note": None},
        {"where": {"lat": 48.85, "tags": ["a", "b"]}, "q": 'a <b>bold</b> & "x"'},
        {},
    ],
)
def test_past_calls_read_back_to_their_arguments(arguments):
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "integer"},
            "city": {"type": "string"},
            "days": {"type": "array", "items": {"type": "integer"}},
            "metric": {"type": "boolean"},
            "note": {"type": ["string", "null"]},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "q": {"type": "string"},
        },
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": arguments}}],
    }
    text = render_chat_template(TEMPLATE, [turn], False)
    reply = text[text.index("]~b]ai\n") + len("]~b]ai\n") : text.rindex("[e~[")]
    found = MiniMaxM3ToolParser().detect_and_parse(reply, [tool])
    assert found.normal_text == ""
    assert [(c.name, json.loads(c.parameters)) for c in found.calls] == [("f", arguments)]


def test_the_template_refuses_what_it_cannot_render():
    with pytest.raises(ValueError, match="thinking_mode=sometimes"):
        render_chat_template(
            TEMPLATE, [{"role": "user", "content": "Hi"}], True, thinking_mode="sometimes"
        )
    with pytest.raises(ValueError, match=r"messages\[0\].role=function"):
        render_chat_template(TEMPLATE, [{"role": "function", "content": "x"}], True)


def test_a_request_reaches_it_through_the_tokenizers_option():
    tokenizer = TransformersTokenizer.from_pretrained(
        BUNDLED_TARGET, chat_template=str(TEMPLATE_FILE)
    )
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "Hi"}], tools=[ADD], reasoning_effort="high"
    )
    text = tokenizer.apply_chat_template(
        [m.for_template() for m in body.messages], **body.template_kwargs()
    )
    assert text.startswith(SYSTEM.format(line=LINES["enabled"]) + "]~b]developer\n# Tools\n")
    assert text.endswith("]~b]user\nHi[e~[\n]~b]ai\n<mm:think>")
