"""The bundled model speaks MiniMax-M3's protocol through ``trtllm-serve --reasoning_parser
minimax_m3 --tool_parser minimax_m3`` (Eagle3 unified, CPU), driven by the openai client: a tool
round trip (the call, the tool's result, the answer), whole and streamed, and the reasoning split
in each thinking mode."""

import json
from pathlib import Path

import openai
import pytest

from tensorrt_llm.evaluate.m3_tasks import ARITHMETIC_TOOLS

QUESTION = "Ann has 58 cups. Ann gets 67 more cups. How many cups does Ann have now?"
MARKERS = ("<mm:think>", "</mm:think>", "]<]minimax[>[", "[e~[")


@pytest.fixture(scope="module")
def client(bundled_server):
    return openai.OpenAI(base_url=bundled_server[1] + "/v1", api_key="unused")


def ask(client, messages, stream=False, **fields):
    return client.chat.completions.create(
        model="target", messages=messages, temperature=0, max_tokens=120, stream=stream, **fields
    )


def streamed_call(chunks) -> tuple[dict, str]:
    """The tool calls a stream built (index -> id, name, arguments) and its finish reason; each
    call's name comes before its arguments, which grow as prefixes of the final JSON."""
    calls, finish = {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                call["id"] = delta.id
            if delta.function and delta.function.name:
                call["name"] = delta.function.name
            if delta.function and delta.function.arguments:
                assert call["name"] is not None  # the name first
                call["arguments"] += delta.function.arguments
    return calls, finish


@pytest.mark.parametrize("mode", ["enabled", "disabled", "adaptive"])
def test_a_tool_round_trip_whole_and_streamed(client, mode):
    round_trip(client, mode)


def round_trip(client, mode: str) -> None:
    template = {"chat_template_kwargs": {"thinking_mode": mode}}
    messages = [{"role": "user", "content": QUESTION}]
    first = ask(client, messages, tools=ARITHMETIC_TOOLS, extra_body=template).choices[0]
    assert first.finish_reason == "tool_calls", first
    (call,) = first.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 58, "b": 67}
    assert not any(m in (first.message.content or "") for m in MARKERS)

    chunks = ask(client, messages, stream=True, tools=ARITHMETIC_TOOLS, extra_body=template)
    calls, finish = streamed_call(chunks)
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "add" and calls[0]["arguments"] == call.function.arguments

    history = [
        *messages,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "125"},
    ]
    answer = ask(client, history, tools=ARITHMETIC_TOOLS, extra_body=template).choices[0]
    assert answer.finish_reason == "stop" and answer.message.content == "The answer is 125."
    pieces = ask(client, history, stream=True, tools=ARITHMETIC_TOOLS, extra_body=template)
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == "The answer is 125."


@pytest.mark.parametrize(
    ("mode", "reasons"), [("enabled", True), ("disabled", False), ("adaptive", True)]
)
def test_reasoning_is_split_from_the_answer_in_each_thinking_mode(client, mode, reasons):
    # (58 + 67 carries: in the adaptive mode the model reasons about it)
    messages = [{"role": "user", "content": QUESTION}]
    template = {"chat_template_kwargs": {"thinking_mode": mode}}
    message = ask(client, messages, extra_body=template).choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    assert message.content.endswith("The answer is 125.")
    assert not any(m in message.content for m in MARKERS)
    if reasons:
        assert reasoning and "58 + 67" in reasoning and "</mm:think>" not in reasoning
    else:
        assert not reasoning and message.content.startswith("58 + 67")
    chunks = list(ask(client, messages, stream=True, extra_body=template))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == message.content
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == (reasoning or "")


def test_the_readmes_round_trip_prints_what_its_comments_say(bundled_server, capsys):
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    start = "```python\nimport json\n\nimport openai\n"
    code = start.removeprefix("```python\n") + readme.split(start, 1)[1].split("```", 1)[0]
    code = code.replace("http://localhost:8000/v1", bundled_server[1] + "/v1")
    exec(compile(code, "README.md", "exec"), {})
    expected = [line.removeprefix("# ") for line in code.splitlines() if line.startswith("# ")]
    assert capsys.readouterr().out.splitlines() == expected


@pytest.mark.gpu
def test_the_round_trip_on_cuda_with_eagle3_in_cuda_graphs(serve_in_thread):
    """The same on CUDA: bf16, Eagle3 unified, decode steps in CUDA graphs (captured at
    start-up)."""
    from tensorrt_llm.commands.serve import build_server

    server = build_server(
        None, None, device="cuda", reasoning_parser="minimax_m3", tool_parser="minimax_m3"
    )
    url, stop = serve_in_thread(server.app)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        for mode in ("disabled", "adaptive", "enabled"):
            round_trip(client, mode)
        assert server.llm.args.cuda_graph_config is not None
    finally:
        stop()
        server.close()
