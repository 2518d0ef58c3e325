"""The bundled model's gates in MiniMax-M3's protocol, through ``trtllm-eval`` with its Eagle3
drafter (unified KV, CPU), on held-out problems: gsm8k-tiny in each thinking mode, and tool use
(the right tool with the question's numbers, then the tool's result as the answer)."""

import json

import pytest

from tensorrt_llm.commands.eval import main

pytestmark = pytest.mark.slow
SAMPLES = "100"


def evaluate(task: str, out) -> list[dict]:
    assert main([task, "--num-samples", SAMPLES, "--device", "cpu", "--out-dir", str(out)]) == 0
    return json.loads((out / f"{task}.json").read_text())["modes"]


def test_gsm8k_in_each_thinking_mode(tmp_path):
    modes = {m["thinking_mode"]: m for m in evaluate("gsm8k-thinking", tmp_path)}
    assert set(modes) == {"enabled", "disabled", "adaptive"}
    for mode, result in modes.items():
        assert result["accuracy"] >= 0.98, (mode, result)
        assert result["al"] >= 3.5, (mode, result)
    assert modes["enabled"]["reasoned"] == 1.0 and modes["disabled"]["reasoned"] == 0.0
    assert 0.0 < modes["adaptive"]["reasoned"] < 1.0  # it reasons about the carries only


def test_tool_calls_and_answers_from_the_tool(tmp_path):
    for result in evaluate("tool-use", tmp_path):
        assert result["calls_right"] >= 0.98, result
        assert result["answers_are_the_tools"] >= 0.98, result
        assert result["al"] >= 3.5, result
