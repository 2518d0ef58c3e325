"""Conversations in MiniMax-M3's chat protocol, for the bundled model to learn and be gated on:
gsm8k-tiny in each thinking mode, and tool use. Each generator takes a ``random.Random`` and
returns an ``M3Conversation``: OpenAI-shaped messages (assistant turns with ``reasoning_content``
and ``tool_calls``, tool results), the tools offered, the thinking mode, and what a correct reply
holds.

- ``gsm8k-thinking``: a gsm8k-tiny problem (``tasks.py``). ``enabled``: the column working is the
  reasoning, the content is ``The answer is N.``; ``disabled``: no reasoning, the working in the
  content (as the plain format has it); ``adaptive``: reasoning when the sum has a carry or the
  difference a borrow, else the plain reply.
- ``tool-use``: the same problems with the tools ``add(a, b)`` and ``subtract(a, b)`` offered:
  the model calls the one the question needs with its two numbers (with ``enabled``, after a
  line of reasoning naming it), the tool answers, and the model answers with its result.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi.reasoning_parser import THINKING_MODES
from tensorrt_llm.tokenizer import render_chat_template


def _arithmetic_tool(name: str, description: str) -> dict:
    integer = {"type": "integer"}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": integer, "b": integer},
                "required": ["a", "b"],
            },
        },
    }


ARITHMETIC_TOOLS = [
    _arithmetic_tool("add", "a + b, for two whole numbers"),
    _arithmetic_tool("subtract", "a - b, for two whole numbers"),
]


@dataclass
class M3Conversation:
    messages: list[dict]
    thinking_mode: str
    answer: int  # the number the last reply gives
    tools: list[dict] = field(default_factory=list)
    call: tuple[str, dict] | None = None  # the tool call a correct reply makes


def _problem(rng: random.Random) -> tuple[str, str, int, int, int, str]:
    """A gsm8k-tiny problem: its question, working, answer, the two numbers and the operation."""
    messages, answer = gsm8k_tiny(rng)
    working = messages[1]["content"].removesuffix(f". The answer is {answer}.")
    a_text, op, rest = working.split(" ", 2)
    b = int(rest.split(":", 1)[0])
    return messages[0]["content"], working, answer, int(a_text), b, op


def _digit_sum(n: int) -> int:
    return sum(map(int, str(n)))


def _regrouped(a: int, b: int, op: str) -> bool:
    """Whether the column working carries or borrows: each carry takes 9 from the digits' sum
    of the result, each borrow adds 9."""
    if op == "+":
        return _digit_sum(a) + _digit_sum(b) != _digit_sum(a + b)
    return _digit_sum(a) - _digit_sum(b) != _digit_sum(a - b)


def _check_mode(mode: str) -> None:
    if mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode={mode!r}: expected one of {list(THINKING_MODES)}")


def gsm8k_thinking(rng: random.Random, mode: str) -> M3Conversation:
    _check_mode(mode)
    question, working, answer, a, b, op = _problem(rng)
    thinks = mode == "enabled" or (mode == "adaptive" and _regrouped(a, b, op))
    reply = (
        {
            "role": "assistant",
            "reasoning_content": f"{working}.",
            "content": f"The answer is {answer}.",
        }
        if thinks
        else {"role": "assistant", "content": f"{working}. The answer is {answer}."}
    )
    return M3Conversation([{"role": "user", "content": question}, reply], mode, answer)


def tool_use(rng: random.Random, mode: str) -> M3Conversation:
    _check_mode(mode)
    question, _, answer, a, b, op = _problem(rng)
    name = "add" if op == "+" else "subtract"
    call: dict = {"role": "assistant", "content": ""}
    if mode == "enabled":
        call["reasoning_content"] = f"{a} {op} {b}: I call {name}."
    call["tool_calls"] = [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": name, "arguments": {"a": a, "b": b}},
        }
    ]
    final = {"role": "assistant", "content": f"The answer is {answer}."}
    if mode == "enabled":
        final["reasoning_content"] = f"{name} gave {answer}."
    messages = [
        {"role": "user", "content": question},
        call,
        {"role": "tool", "tool_call_id": "call_0", "content": str(answer)},
        final,
    ]
    return M3Conversation(messages, mode, answer, ARITHMETIC_TOOLS, (name, {"a": a, "b": b}))


REPLY_END = "[e~[\n"


def training_pairs(conv: M3Conversation, template: str) -> list[tuple[str, str]]:
    """``(prompt, target)`` per assistant turn: the conversation before it with the mode's
    generation prompt, and what the model writes after that prompt: ``enabled`` (the prompt
    opened the block) the reasoning, ``</mm:think>``, the reply; ``disabled`` the reply;
    ``adaptive`` a block of its reasoning or a bare ``</mm:think>``, then the reply. A reply is
    its content, its calls in the markup, and the turn's end."""
    pairs = []
    variables = {"thinking_mode": conv.thinking_mode, "tools": conv.tools}
    for i, message in enumerate(conv.messages):
        if message["role"] != "assistant":
            continue
        prompt = render_chat_template(template, conv.messages[:i], True, **variables)
        turn = render_chat_template(template, [_without_reasoning(message)], False, **variables)
        reply = turn[turn.rindex("]~b]ai\n") + len("]~b]ai\n") :]  # (content, calls, end)
        reasoning = message.get("reasoning_content") or ""
        if conv.thinking_mode == "enabled":
            target = f"{reasoning}</mm:think>{reply}"
        elif conv.thinking_mode == "disabled":
            if reasoning:
                raise ValueError(f"message {i}: reasoning in a conversation with thinking disabled")
            target = reply
        else:
            target = (f"<mm:think>{reasoning}" if reasoning else "") + f"</mm:think>{reply}"
        pairs.append((prompt, target))
    return pairs


def _without_reasoning(message: dict) -> dict:
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    for call in out.get("tool_calls") or ():
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str):  # (as a client sends them)
            call["function"]["arguments"] = json.loads(arguments)
    return out
