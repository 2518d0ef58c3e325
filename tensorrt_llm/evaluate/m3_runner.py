"""The M3-protocol tasks against an ``LLM`` whose checkpoint speaks it (its ``chat_template.jinja``):
gsm8k-tiny in a thinking mode, and tool use. A reply is read as the server reads it: its
reasoning split off (``reasoning_parser``), its tool calls read (``tool_parser``).

- ``gsm8k-thinking``: accuracy of ``The answer is N.`` in the content; the share of replies that
  reasoned (a reasoning block) in the mode.
- ``tool-use``: the tools ``add`` and ``subtract`` offered; a call is right when it is the one
  tool the problem needs with its two numbers; the tool then runs on the arguments the model
  gave, its result goes back as the tool's turn, and the answer is right when it states that
  result.

Problems: gsm8k-tiny's evaluation stream (``tasks.evaluation_problems``), held out of training.
Each result has the mean AL of its replies (``al``: 1 without speculative decoding).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from tensorrt_llm.evaluate.m3_tasks import ARITHMETIC_TOOLS
from tensorrt_llm.evaluate.runner import mean_al
from tensorrt_llm.evaluate.tasks import evaluation_problems, parse_answer
from tensorrt_llm.llmapi.reasoning_parser import ReasoningParserFactory
from tensorrt_llm.sampling_params import SamplingParams
from tensorrt_llm.serve.tool_parser import ToolParserFactory

GREEDY = SamplingParams(max_tokens=160, temperature=0)
TOOLS = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b}


def _replies(llm, conversations: list[list[dict]], mode: str, tools: list | None):
    """Each conversation's next reply, read: ``(reasoning, content, calls, output)``."""
    variables = {"thinking_mode": mode, **({"tools": tools} if tools else {})}
    prompts = [llm.tokenizer.apply_chat_template(c, **variables) for c in conversations]
    outputs = llm.generate(prompts, GREEDY) if prompts else []
    out = []
    for prompt, output in zip(prompts, outputs, strict=True):
        reasoning = ReasoningParserFactory.create_reasoning_parser("minimax_m3", prompt=prompt)
        split = reasoning.parse(output.outputs[0].text)
        calls = ToolParserFactory.create_tool_parser("minimax_m3").detect_and_parse(
            split.content, tools or []
        )
        out.append((split.reasoning_content, calls.normal_text, calls.calls, output))
    return out


def run_gsm8k_thinking(llm, count: int, mode: str, progress: Callable[[str], None] = print) -> dict:
    problems = evaluation_problems("gsm8k-tiny", count)
    replies = _replies(llm, [messages[:1] for messages, _ in problems], mode, None)
    correct = [
        parse_answer(content) == answer
        for (_, content, _, _), (_, answer) in zip(replies, problems, strict=True)
    ]
    result = {
        "thinking_mode": mode,
        "accuracy": sum(correct) / len(correct),
        "reasoned": sum(bool(r[0]) for r in replies) / len(replies),
        "al": mean_al([r[3] for r in replies]),
        "num_samples": len(correct),
        "texts": [r[3].outputs[0].text for r in replies],
    }
    progress(
        f"gsm8k-tiny ({mode}): {sum(correct)}/{len(correct)} correct, "
        f"{result['reasoned']:.2f} reasoned, AL {result['al']:.3f}"
    )
    return result


def run_tool_use(llm, count: int, mode: str, progress: Callable[[str], None] = print) -> dict:
    problems = evaluation_problems("gsm8k-tiny", count)
    questions = [messages[0] for messages, _ in problems]
    first = _replies(llm, [[q] for q in questions], mode, ARITHMETIC_TOOLS)
    calls_right, histories, results = [], [], []
    for question, (_, answer), (reasoning, content, calls, _) in zip(
        questions, problems, first, strict=True
    ):
        a, b = _numbers(question["content"])
        needed = ("add" if a + b == answer else "subtract", {"a": a, "b": b})
        made = [(c.name, json.loads(c.parameters)) for c in calls]
        calls_right.append(made == [needed])
        result = _run(made[0]) if len(made) == 1 else None
        results.append(result)
        turn = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
        if made:
            turn["tool_calls"] = [{"function": {"name": n, "arguments": args}} for n, args in made]
        histories.append([question, turn, {"role": "tool", "content": str(result)}])
    called = [i for i, r in enumerate(results) if r is not None]
    second = _replies(llm, [histories[i] for i in called], mode, ARITHMETIC_TOOLS)
    answered = [
        parse_answer(content) == results[i]
        for i, (_, content, _, _) in zip(called, second, strict=True)
    ]
    result = {
        "thinking_mode": mode,
        "calls_right": sum(calls_right) / len(calls_right),
        "answers_are_the_tools": sum(answered) / len(calls_right),
        "al": mean_al([r[3] for r in first + second]),
        "num_samples": len(calls_right),
        "texts": [r[3].outputs[0].text for r in first + second],
    }
    progress(
        f"tool-use ({mode}): calls right {result['calls_right']:.3f}, answers from the tool "
        f"{result['answers_are_the_tools']:.3f}, AL {result['al']:.3f}"
    )
    return result


def _numbers(question: str) -> tuple[int, int]:
    words = question.replace(".", " ").replace("?", " ").split()
    a, b = [int(w) for w in words if w.isdigit()][:2]
    return a, b


def _run(call: tuple[str, dict]) -> int | None:
    """The tool's result on the model's arguments (None when they do not fit it)."""
    name, arguments = call
    tool = TOOLS.get(name)
    if tool is None or set(arguments) != {"a", "b"}:
        return None
    if not all(isinstance(v, int) for v in arguments.values()):
        return None
    return tool(arguments["a"], arguments["b"])
