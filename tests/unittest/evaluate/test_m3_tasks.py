"""The M3-format conversations the bundled model learns: each thinking mode's reply, tool use,
and both rendered by M3's chat template in the markup the server's parsers read back."""

import json
import random
from pathlib import Path

import pytest

from tensorrt_llm.evaluate.m3_tasks import (
    ARITHMETIC_TOOLS,
    REPLY_END,
    THINKING_MODES,
    _regrouped,
    gsm8k_thinking,
    tool_use,
    training_pairs,
)
from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi.reasoning_parser import ReasoningParserFactory
from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest
from tensorrt_llm.serve.tool_parser import MiniMaxM3ToolParser
from tensorrt_llm.tokenizer import render_chat_template

TEMPLATE = (Path(__file__).resolve().parents[3] / "examples/templates/minimax_m3.jinja").read_text()


def columns_regroup(a: int, b: int, op: str) -> bool:
    """Carry or borrow, column by column (the oracle of the digit-sum rule)."""
    carry = 0
    for col in range(3):
        x, y = a // 10**col % 10, b // 10**col % 10
        carry = int(x + y + carry >= 10) if op == "+" else int(x - carry < y)
        if carry:
            return True
    return False


def test_a_carry_or_a_borrow_is_found_for_every_problem():
    for a in range(2, 101):
        for b in range(1, 101):
            assert _regrouped(a, b, "+") == columns_regroup(a, b, "+"), (a, b)
            if b <= a:
                assert _regrouped(a, b, "-") == columns_regroup(a, b, "-"), (a, b)


@pytest.mark.parametrize("mode", THINKING_MODES)
def test_each_mode_replies_in_its_shape_and_reads_back(mode):
    rng, plain_rng = random.Random(5), random.Random(5)
    parser = ReasoningParserFactory.create_reasoning_parser("minimax_m3", {"thinking_mode": mode})
    for _ in range(40):
        conv = gsm8k_thinking(rng, mode)
        plain, answer = gsm8k_tiny(plain_rng)  # (the same problem in the plain format)
        reply = conv.messages[1]
        assert conv.answer == answer and conv.messages[0] == plain[0]
        if "reasoning_content" in reply:
            assert mode != "disabled"
            assert (
                f"{reply['reasoning_content'][:-1]}. The answer is {answer}." == plain[1]["content"]
            )
            assert reply["content"] == f"The answer is {answer}."
        else:
            assert mode != "enabled" and reply["content"] == plain[1]["content"]
        # what the model writes after the generation prompt, read by the reasoning parser
        prompt = render_chat_template(TEMPLATE, conv.messages[:1], True, thinking_mode=mode)
        whole = render_chat_template(TEMPLATE, conv.messages, False, thinking_mode=mode)
        written = whole[len(prompt.removesuffix("<mm:think>").removesuffix("</mm:think>")) :]
        written = written.removesuffix("[e~[\n")
        if mode == "enabled":
            written = written.removeprefix("<mm:think>")
        split = parser.parse(written)
        assert split.content == reply["content"]
        assert split.reasoning_content == reply.get("reasoning_content", "")


@pytest.mark.parametrize("mode", THINKING_MODES)
def test_tool_use_calls_the_right_tool_and_answers_with_its_result(mode):
    rng = random.Random(9)
    for _ in range(40):
        conv = tool_use(rng, mode)
        name, arguments = conv.call
        question = conv.messages[0]["content"]
        numbers = [
            int(w) for w in question.replace(".", " ").replace("?", " ").split() if w.isdigit()
        ]
        assert [arguments["a"], arguments["b"]] == numbers[:2]
        assert name == ("add" if "more" in question else "subtract")
        assert conv.messages[2]["content"] == str(conv.answer)
        assert conv.messages[3]["content"] == f"The answer is {conv.answer}."
        # as a client sends it back (arguments as JSON text): a valid request
        sent = json.loads(json.dumps(conv.messages))
        sent[1]["tool_calls"][0]["function"]["arguments"] = json.dumps(arguments)
        body = ChatCompletionRequest(
            messages=sent, tools=conv.tools, chat_template_kwargs={"thinking_mode": mode}
        )
        text = render_chat_template(
            TEMPLATE, [m.for_template() for m in body.messages], False, **body.template_kwargs()
        )
        reply = text.split("]~b]ai\n")[1].split("[e~[")[0]
        if "<mm:think>" in reply:
            reply = reply.split("</mm:think>", 1)[1]
        found = MiniMaxM3ToolParser().detect_and_parse(reply, ARITHMETIC_TOOLS)
        assert [(c.name, json.loads(c.parameters)) for c in found.calls] == [conv.call]


@pytest.mark.parametrize("mode", THINKING_MODES)
def test_training_targets_read_back_to_the_turns_they_teach(mode):
    """What the model learns to write after each generation prompt is what the server's parsers
    turn back into the turn's reasoning, content and calls."""
    rng = random.Random(3)
    suffix = {"enabled": "<mm:think>", "disabled": "</mm:think>", "adaptive": ""}[mode]
    for conv in [gsm8k_thinking(rng, mode) for _ in range(10)] + [
        tool_use(rng, mode) for _ in range(10)
    ]:
        turns = [m for m in conv.messages if m["role"] == "assistant"]
        pairs = training_pairs(conv, TEMPLATE)
        assert len(pairs) == len(turns)
        for (prompt, target), turn in zip(pairs, turns, strict=True):
            assert prompt.endswith("]~b]ai\n" + suffix) and target.endswith(REPLY_END)
            reasoning = ReasoningParserFactory.create_reasoning_parser(
                "minimax_m3", {"thinking_mode": mode}
            )
            split = reasoning.parse(target.removesuffix(REPLY_END))
            assert split.reasoning_content == turn.get("reasoning_content", "")
            found = MiniMaxM3ToolParser().detect_and_parse(split.content, conv.tools)
            assert found.normal_text == turn["content"]
            calls = [
                (c["function"]["name"], c["function"]["arguments"])
                for c in turn.get("tool_calls", [])
            ]
            assert [(c.name, json.loads(c.parameters)) for c in found.calls] == calls
