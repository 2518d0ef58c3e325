"""A chat request's template variables and history: the ways to ask for thinking mapped onto the
template's ``thinking_mode`` (disagreeing ways refused), assistant messages with their reasoning
and tool calls (arguments sent as JSON text rendered as objects), tool results, and all of it
reaching the template through the server's rendering."""

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from tensorrt_llm.bundled import BUNDLED_TARGET
from tensorrt_llm.serve.media import short_chat_prompt
from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest, ChatMessage
from tensorrt_llm.tokenizer import TransformersTokenizer

USER = {"role": "user", "content": "What is 2 + 3?"}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[USER], **fields)


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ({}, "adaptive"),
        ({"chat_template_kwargs": {"thinking_mode": "enabled"}}, "enabled"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "disabled"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "enabled"),
        ({"thinking": {"type": "disabled", "budget_tokens": 10}}, "disabled"),
        ({"thinking": {"type": "auto"}}, "adaptive"),
        ({"reasoning_effort": "none"}, "disabled"),
        ({"reasoning_effort": "low"}, "adaptive"),
        ({"reasoning_effort": "high"}, "enabled"),
        # several ways that agree
        ({"reasoning_effort": "high", "thinking": {"type": "enabled"}}, "enabled"),
    ],
)
def test_each_way_to_ask_for_thinking_sets_the_templates_thinking_mode(fields, mode):
    assert request(**fields).template_kwargs()["thinking_mode"] == mode


def test_other_template_variables_pass_through():
    kwargs = request(chat_template_kwargs={"enable_thinking": True, "today": "Monday"})
    assert kwargs.template_kwargs() == {
        "enable_thinking": True,
        "today": "Monday",
        "thinking_mode": "enabled",
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"reasoning_effort": "none", "thinking": {"type": "enabled"}},
            "thinking.type asks enabled, reasoning_effort asks disabled",
        ),
        ({"chat_template_kwargs": {"thinking_mode": "sometimes"}}, "thinking_mode='sometimes'"),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "enable_thinking must be"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_a_request_whose_thinking_cannot_be_told_is_refused_naming_why(fields, message):
    with pytest.raises(ValidationError, match=message):
        request(**fields)


def test_an_assistant_turn_keeps_its_reasoning_and_its_calls_arguments_as_an_object():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2}'},
    }
    turn = ChatMessage(role="assistant", content=None, reasoning_content="sum", tool_calls=[call])
    assert turn.for_template() == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "sum",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
        ],
    }
    result = ChatMessage(role="tool", content="5", tool_call_id="call_1")
    assert result.for_template() == {"role": "tool", "content": "5", "tool_call_id": "call_1"}
    # every text that reaches the prompt is named for the guards (control tokens, length)
    assert [param for param, _ in turn.texts(1)] == [
        "messages.1.content",
        "messages.1.reasoning_content",
        "messages.1.tool_calls.0.function.name",
        "messages.1.tool_calls.0.function.arguments",
    ]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "arguments\\n.*is not JSON",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "must be a JSON object",
        ),
        ({"role": "user", "content": "a", "reasoning_content": "b"}, "belongs to an assistant"),
        ({"role": "tool", "tool_call_id": "c"}, "needs content"),
        ({"role": "assistant"}, "needs content or tool_calls"),
    ],
)
def test_a_malformed_history_message_is_refused(message, error):
    with pytest.raises(ValidationError, match=error):
        ChatMessage(**message)


def test_the_request_variables_and_history_reach_the_template():
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.reasoning_content %}(r {{ m.reasoning_content }}){% endif %}"
        "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} a={{ c.function.arguments.a }})"
        "{% endfor %};{% endfor %}mode={{ thinking_mode }}"
    )
    tokenizer = TransformersTokenizer.from_pretrained(BUNDLED_TARGET, chat_template=template)
    llm = SimpleNamespace(tokenizer=tokenizer)
    body = ChatCompletionRequest(
        messages=[
            USER,
            {
                "role": "assistant",
                "reasoning_content": "add",
                "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
            },
            {"role": "tool", "content": "5"},
        ],
        reasoning_effort="high",
    )
    ids = short_chat_prompt(llm, body.messages, body.template_kwargs())
    assert tokenizer.decode(ids) == (
        "user:What is 2 + 3?;assistant:(r add)(call add a=2);tool:5;mode=enabled"
    )
