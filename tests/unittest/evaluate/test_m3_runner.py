"""The M3-protocol tasks' scoring, on a stand-in model that replies in the protocol: right calls
and answers count as right, and a wrong tool, wrong numbers or an answer that is not the tool's
result count as wrong."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tensorrt_llm.bundled import BUNDLED_TARGET
from tensorrt_llm.evaluate.m3_runner import run_gsm8k_thinking, run_tool_use
from tensorrt_llm.tokenizer import TransformersTokenizer

TEMPLATE = Path(__file__).resolve().parents[3] / "examples/templates/minimax_m3.jinja"
NS = "]<]minimax[>["


class ScriptedModel:
    """Replies as a trained model would (``mistake`` spoils some replies)."""

    def __init__(self, mistake: str | None = None) -> None:
        self.tokenizer = TransformersTokenizer.from_pretrained(
            BUNDLED_TARGET, chat_template=str(TEMPLATE)
        )
        self.mistake = mistake

    def generate(self, prompts, params):
        return [
            SimpleNamespace(
                outputs=[SimpleNamespace(text=self.reply(p), avg_decoded_tokens_per_iter=1.0)]
            )
            for p in prompts
        ]

    def reply(self, prompt: str) -> str:
        opened = prompt.endswith("<mm:think>")
        think = ("" if opened else "<mm:think>") + "working</mm:think>"
        if "<response>" in prompt:  # the tool answered
            result = int(re.findall(r"<response>(-?\d+)</response>", prompt)[-1])
            return think + f"The answer is {result + (self.mistake == 'answer')}."
        question = prompt.rsplit("]~b]user\n", 1)[1]
        a, b = [int(n) for n in re.findall(r"\d+", question)][:2]
        if "]~b]developer" not in prompt:  # no tools: the working and the answer
            return think + f"The answer is {a + b if 'more' in question else a - b}."
        name = "add" if "more" in question else "subtract"
        if self.mistake == "tool":
            name = "subtract" if name == "add" else "add"
        args = f"{NS}<a>{a}{NS}</a>{NS}<b>{b + (self.mistake == 'numbers')}{NS}</b>"
        return (
            think
            + f'{NS}<tool_call>\n{NS}<invoke name="{name}">{args}{NS}</invoke>\n{NS}</tool_call>'
        )


@pytest.mark.parametrize("mode", ["enabled", "adaptive"])
def test_a_model_that_calls_and_answers_right_scores_one(mode):
    result = run_tool_use(ScriptedModel(), 20, mode, progress=lambda line: None)
    assert result["calls_right"] == result["answers_are_the_tools"] == 1.0
    gsm8k = run_gsm8k_thinking(ScriptedModel(), 20, mode, progress=lambda line: None)
    assert gsm8k["accuracy"] == 1.0 and gsm8k["reasoned"] == 1.0


@pytest.mark.parametrize(
    ("mistake", "calls", "answers"),
    [("tool", 0.0, 1.0), ("numbers", 0.0, 1.0), ("answer", 1.0, 0.0)],
)
def test_a_wrong_tool_wrong_numbers_or_a_wrong_answer_count_as_wrong(mistake, calls, answers):
    # (a wrong call still runs: the answer is scored against what the tool gave)
    result = run_tool_use(ScriptedModel(mistake), 20, "enabled", progress=lambda line: None)
    assert (result["calls_right"], result["answers_are_the_tools"]) == (calls, answers)
