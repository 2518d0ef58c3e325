"""Three processes on loopback: a router, a context server and a generation server (NIXL over UCX,
DRAM), against an aggregated server, all on the bundled model with Eagle3 and the unified cache and
MiniMax-M3's reasoning and tool parsers."""

import json
import time

import httpx
import openai
import pytest

from tensorrt_llm.bundled import bundled_prompt
from tensorrt_llm.evaluate.deployment import disaggregation_options, metric, running
from tensorrt_llm.evaluate.m3_tasks import ARITHMETIC_TOOLS

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow
QUESTIONS = [
    "Ann has 58 cups. Ann gets 67 more cups. How many cups does Ann have now?",
    "Ben has 93 pens. Ben gives away 45 pens. How many pens does Ben have left?",
    "Remember this list: red moon 4821 fish gold",
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with running(tmp_path_factory.mktemp("disagg")) as servers:
        servers.reserve("ctx", "gen", "router", "agg")
        worker = disaggregation_options({"kv_cache_config": {"max_tokens": 65536}})
        parsers = ["--reasoning_parser", "minimax_m3", "--tool_parser", "minimax_m3"]
        servers.server("ctx", worker, flags=parsers)
        servers.server("gen", worker, flags=parsers)
        servers.server("agg", {}, flags=parsers)
        servers.router("router", ["ctx"], ["gen"])
        servers.wait_healthy()
        yield servers.urls


def ask(url: str, question: str, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": question}]
    if stream:
        chunks = client.chat.completions.create(
            model="target", messages=messages, temperature=0, max_tokens=80, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks)
    return (
        client.chat.completions.create(
            model="target", messages=messages, temperature=0, max_tokens=80
        )
        .choices[0]
        .message.content
    )


def test_disaggregated_replies_equal_aggregated_and_the_kv_really_moved(deployment):
    for q in QUESTIONS:
        expected = ask(deployment["agg"], q)
        assert ask(deployment["router"], q) == expected
        assert ask(deployment["router"], q, stream=True) == expected
    gen, ctx = deployment["gen"], deployment["ctx"]
    assert (
        metric(gen, "trtllm_context_tokens_computed_total") == 0
    )  # no prefill on the generation server
    assert metric(gen, "trtllm_transferred_tokens_total") > 0
    assert metric(ctx, "trtllm_context_tokens_computed_total") > 0
    deadline = time.time() + 10
    while time.time() < deadline and metric(ctx, "trtllm_held_for_transfer"):
        time.sleep(0.2)  # released once pulled
    for url in (ctx, gen):
        assert metric(url, "trtllm_held_for_transfer") == 0
        assert metric(url, 'trtllm_kv_cache_slots{state="used"}') == 0


def chat(url: str, stream: bool, **fields) -> dict:
    """A chat reply as its parts: content, reasoning and tool calls (``id`` aside), whole or
    joined from the stream."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    reply = client.chat.completions.create(
        model="target", messages=messages, temperature=0, max_tokens=80, stream=stream, **fields
    )
    if not stream:
        message = reply.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        reasoning = message.model_extra.get("reasoning_content") or ""
        return {"content": message.content or "", "reasoning": reasoning, "calls": calls}
    parts = {"content": "", "reasoning": "", "calls": {}}
    for chunk in reply:
        delta = chunk.choices[0].delta
        parts["content"] += delta.content or ""
        parts["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            name, args = parts["calls"].get(call.index, ("", ""))
            parts["calls"][call.index] = (
                name + (call.function.name or ""),
                args + (call.function.arguments or ""),
            )
    parts["calls"] = [parts["calls"][i] for i in sorted(parts["calls"])]
    return parts


def test_disaggregated_reasoning_and_tool_calls_equal_aggregated(deployment):
    thinking = {"extra_body": {"chat_template_kwargs": {"thinking_mode": "enabled"}}}
    tools = {"tools": ARITHMETIC_TOOLS}
    for fields in (thinking, tools):
        expected = chat(deployment["agg"], False, **fields)
        for stream in (False, True):
            assert chat(deployment["router"], stream, **fields) == expected, (fields, stream)
    assert chat(deployment["agg"], False, **thinking)["reasoning"]
    ((name, arguments),) = chat(deployment["agg"], False, **tools)["calls"]
    assert name == "add" and json.loads(arguments) == {"a": 58, "b": 67}


def test_a_hundred_mixed_requests_with_cancellations_leave_no_slot_held(deployment):
    router = deployment["router"]
    jobs = []
    for i in range(100):
        question = QUESTIONS[i % len(QUESTIONS)] + f" ({i})"
        jobs.append((i, question))

    def run(job):
        i, question = job
        messages = [{"role": "user", "content": question}]
        if i % 4 == 0:  # cancelled mid-stream: read one event, then hang up
            with httpx.stream(
                "POST",
                router + "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 200, "stream": True, "ignore_eos": True},
                timeout=120,
            ) as reply:
                for _ in reply.iter_lines():
                    break
            return "cancelled"
        if i % 4 == 1:
            text = ask(router, question, stream=True)
        elif i % 4 == 2:
            reply = httpx.post(
                router + "/v1/completions",
                json={
                    "prompt": bundled_prompt(question),
                    "max_tokens": 40,
                    "temperature": 0,
                },
                timeout=120,
            )
            text = reply.json()["choices"][0]["text"]
        else:
            text = ask(router, question)
        return text

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(run, jobs))
    assert results.count("cancelled") == 25 and all(isinstance(r, str) for r in results)
    deadline = time.time() + 30
    reports = {}
    while time.time() < deadline:
        reports = {
            name: httpx.get(deployment[name] + "/kv_cache", timeout=30).json()
            for name in ("ctx", "gen")
        }
        if all(
            r["KV_CACHE_MANAGER"]["used"] == 0 and r["held_for_transfer"] == 0
            for r in reports.values()
        ):
            break
        time.sleep(0.5)
    for name, report in reports.items():  # each report ran check_integrity() on that server
        assert report["KV_CACHE_MANAGER"]["used"] == 0, (name, report)
        assert report["held_for_transfer"] == 0 and report["active_requests"] == 0, (name, report)
