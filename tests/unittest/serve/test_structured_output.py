"""Structured output through the server: ``response_format`` and ``tool_choice`` as grammars
(``serve/structured_output.py``), walked over M3's markup with a matcher, then through the
``openai`` client against ``trtllm-serve --guided_decoding_backend xgrammar`` on a random tiny
M3 (its tokenizer and chat template): whatever the model's weights, every reply is what the
request asked for."""

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tensorrt_llm._torch.pyexecutor.grammar_matcher import GrammarCompiler
from tensorrt_llm.llmapi.reasoning_parser import MiniMaxM3ReasoningParser
from tensorrt_llm.serve.structured_output import (
    FormatError,
    after_reasoning,
    constraint_field,
    response_guide,
    structured_guide,
    tool_guide,
)
from tensorrt_llm.tokenizer import (
    M3_ALPHABET,
    M3_SPECIAL_TOKENS,
    M3_TEXT_TOKENS,
    build_char_tokenizer,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "llmapi"))
from llm_helpers import guided_m3_client, write_tiny_m3_chat_checkpoint  # noqa: E402

NS = "]<]minimax[>["
TOKENIZER = build_char_tokenizer(M3_ALPHABET, M3_SPECIAL_TOKENS, text_tokens=M3_TEXT_TOKENS)
EOS = TOKENIZER.token_to_id("[e~[")
NUMBER = {"type": "integer", "minimum": 0, "maximum": 99}
PAIR = {"type": "object", "properties": {"a": NUMBER, "b": NUMBER}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": PAIR}}
    for name in ("add", "subtract")
]
CALL = (
    f'{NS}<tool_call>\n{NS}<invoke name="add">{NS}<a>2{NS}</a>{NS}<b>3{NS}</b>{NS}</invoke>\n'
    f"{NS}</tool_call>"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "array", "items": NUMBER, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER, TOKENIZER.get_vocab_size(), [EOS])


def writes(compiler, guide, text: str) -> bool:
    """Whether a matcher of ``guide`` takes ``text`` whole, then the end token."""
    matcher = compiler.matcher(compiler.submit(guide).result(), [EOS])
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(EOS)


@pytest.mark.parametrize(
    ("mode", "text", "taken"),
    [
        ("enabled", 'Paris, then.</mm:think>{"city": "Paris", "days": [1]}', True),
        ("enabled", '{"city": "Paris", "days": [1]}', False),  # the block is open: close it
        ("adaptive", '<mm:think>hm</mm:think>{"city": "Rome", "days": []}', True),
        ("adaptive", '</mm:think>{"city": "Rome", "days": []}', True),
        ("adaptive", '{"city": "Rome", "days": []}', True),
        ("disabled", '{"city": "Rome", "days": []}', True),
        ("disabled", '<mm:think>hm</mm:think>{"city": "Rome", "days": []}', False),
        ("enabled", 'x</mm:think>{"city": "Oslo", "days": []}', False),  # the schema still holds
    ],
)
def test_a_response_format_holds_after_the_reasoning(compiler, mode, text, taken):
    guide = response_guide({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    assert writes(compiler, after_reasoning(guide, MiniMaxM3ReasoningParser, mode), text) is taken


@pytest.mark.parametrize(
    ("choice", "mode", "text", "taken"),
    [
        ("required", "disabled", CALL, True),
        ("required", "enabled", f"2 + 3: add.</mm:think>{CALL}", True),
        ("required", "adaptive", f"</mm:think>{CALL}", True),
        ("required", "disabled", "The answer is 5.", False),  # no call
        ("required", "disabled", f"Sure. {CALL}", False),  # the call at once
        ("required", "disabled", CALL.replace("<a>2", "<a>x"), False),  # an argument off schema
        ({"type": "function", "function": {"name": "subtract"}}, "disabled", CALL, False),
        (
            {"type": "function", "function": {"name": "subtract"}},
            "disabled",
            CALL.replace("add", "subtract"),
            True,
        ),
    ],
)
def test_tool_choice_holds_the_reply_to_a_call_of_the_tools(compiler, choice, mode, text, taken):
    assert writes(compiler, tool_guide(TOOLS, choice, mode), text) is taken


def test_strict_tools_under_auto_hold_a_call_once_opened(compiler):
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    guide = tool_guide(strict, "auto", "disabled")
    assert writes(compiler, guide, "No call: 5.") and writes(compiler, guide, f"Sure. {CALL}")
    assert not writes(compiler, guide, f"Sure. {CALL.replace('<b>3', '<b>three')}")
    assert tool_guide(TOOLS, "auto", "disabled") is None  # nothing strict: nothing held


def test_vllms_structured_outputs_field_gives_the_constraint(compiler):
    """``structured_outputs``: a choice as a grammar of its strings, ``disable_any_whitespace``
    over ``response_format``'s JSON; a second constraint or an unknown key names the field."""
    choice = structured_guide({"choice": ["yes", 'no "way"']}, None)
    assert writes(compiler, choice, 'no "way"') and not writes(compiler, choice, "maybe")
    response = response_guide({"type": "json_schema", "json_schema": {"schema": PAIR}})
    compact = structured_guide({"disable_any_whitespace": True}, response)
    assert writes(compiler, compact, '{"a":2,"b":3}') and not writes(compiler, compact, '{"a": 2')
    assert structured_guide(None, response) is response
    assert constraint_field({"choice": ["a"]}) == "structured_outputs"
    assert constraint_field({"disable_any_whitespace": True}) == "response_format"
    reasoned = after_reasoning(compact, MiniMaxM3ReasoningParser, "enabled")
    assert writes(compiler, reasoned, 'hm</mm:think>{"a":2,"b":3}')
    assert not writes(compiler, reasoned, 'hm</mm:think>{"a": 2, "b": 3}')
    for options, pattern in [
        ({"regex": "a"}, "one constraint at a time; got regex, response_format"),
        ({"whitespace_pattern": " "}, "unknown whitespace_pattern"),
        ({"choice": []}, "a list of strings"),
    ]:
        with pytest.raises(FormatError, match=pattern) as info:
            structured_guide(options, response if "regex" in options else None)
        assert info.value.param == "structured_outputs"


@pytest.fixture(scope="module")
def m3_server(tmp_path_factory, serve_in_thread):
    model = write_tiny_m3_chat_checkpoint(tmp_path_factory.mktemp("m3-chat") / "m3")
    yield from guided_m3_client(model, serve_in_thread)


USER = [{"role": "user", "content": "Weather in Paris for two days?"}]
NO_THINKING = {"chat_template_kwargs": {"thinking_mode": "disabled"}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_through_the_openai_client(m3_server, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    kwargs = dict(model="m3", messages=USER, max_tokens=300, response_format=response_format)
    for sampled in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        reply = m3_server.chat.completions.create(
            **kwargs, **sampled, extra_body=NO_THINKING, stream=stream
        )
        if stream:
            chunks = list(reply)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), SCHEMA)


def test_tool_choice_required_and_named_give_calls_of_the_tools(m3_server):
    for choice, names in (
        ("required", {"add", "subtract"}),
        ({"type": "function", "function": {"name": "subtract"}}, {"subtract"}),
    ):
        reply = m3_server.chat.completions.create(
            model="m3",
            messages=USER,
            max_tokens=400,
            temperature=0,
            tools=TOOLS,
            tool_choice=choice,
            extra_body=NO_THINKING,
        )
        choice0 = reply.choices[0]
        assert choice0.finish_reason == "tool_calls", choice0.message
        for call in choice0.message.tool_calls:
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), PAIR)


def test_a_schema_that_cannot_be_built_is_a_400_and_the_server_goes_on(m3_server):
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object", "properties": 3}},
    }
    with pytest.raises(openai.BadRequestError) as info:
        m3_server.chat.completions.create(
            model="m3", messages=USER, max_tokens=8, response_format=bad
        )
    assert info.value.body["param"] == "response_format"
    reply = m3_server.chat.completions.create(
        model="m3", messages=USER, max_tokens=4, extra_body=NO_THINKING
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_structured_outputs_through_the_server(m3_server):
    """vLLM's body field: a choice holds the reply; two constraints are a 400 naming it."""
    reply = m3_server.chat.completions.create(
        model="m3",
        messages=USER,
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}, **NO_THINKING},
    )
    assert reply.choices[0].message.content in ("Paris", "Rome")
    with pytest.raises(openai.BadRequestError) as info:
        m3_server.chat.completions.create(
            model="m3",
            messages=USER,
            max_tokens=4,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"regex": "a"}},
        )
    assert info.value.body["param"] == "structured_outputs"


@pytest.mark.parametrize(
    ("response_format", "pattern"),
    [
        ({"type": "regex", "regex": "(yes|no), [0-9]{2}"}, r"(yes|no), [0-9]{2}"),
        ({"type": "ebnf", "ebnf": 'root ::= "city: " ("Paris" | "Rome")'}, r"city: (Paris|Rome)"),
        (
            {"type": "structural_tag", "format": {"type": "regex", "pattern": "[a-c]{3}"}},
            r"[a-c]{3}",
        ),
    ],
    ids=["regex", "ebnf", "structural_tag"],
)
def test_upstreams_other_formats_hold_the_reply(m3_server, response_format, pattern):
    import re

    reply = m3_server.chat.completions.create(
        model="m3",
        messages=USER,
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": response_format, **NO_THINKING},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content)


def test_a_tool_round_trip_through_the_openai_client(m3_server):
    """The call (forced by ``tool_choice``: the random model's values, M3's markup), the same
    call streamed (its name first, then its arguments, joined to the whole reply's), then the
    tool's result sent back in the history with the call, answered."""
    kwargs = dict(
        model="m3",
        messages=USER,
        max_tokens=400,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        extra_body=NO_THINKING,
    )
    whole = m3_server.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    call = whole.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name in ("add", "subtract")
    chunks = list(m3_server.chat.completions.create(**kwargs, stream=True))
    streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert streamed[0].function.name == call.function.name
    arguments = "".join(d.function.arguments or "" for d in streamed if d.index == 0)
    assert json.loads(arguments) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    answer = m3_server.chat.completions.create(
        model="m3", messages=history, max_tokens=8, temperature=0, tools=TOOLS,
        extra_body=NO_THINKING,
    )  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def nested_schema_text(levels: int) -> str:
    """A schema of objects ``levels`` deep, as text (past Python's own JSON writer's depth)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


def as_schema(schema: str) -> str:
    return f'{{"type": "json_schema", "json_schema": {{"name": "s", "schema": {schema}}}}}'


def wide(key: str, count: int) -> str:
    return json.dumps({key: {f"p{i}": {} for i in range(count)}} if key == "properties" else
                      {key: list(range(count))})  # fmt: skip


PAST_A_LIMIT = [  # (the body's constraint fields as JSON text, the field the 400 names)
    (f'"response_format": {as_schema(nested_schema_text(400))}', "response_format"),
    (f'"response_format": {as_schema(nested_schema_text(70))}', "response_format"),
    (f'"response_format": {as_schema(wide("properties", 1100))}', "response_format"),
    (f'"response_format": {as_schema(wide("enum", 1100))}', "response_format"),
    (f'"response_format": {as_schema(json.dumps({"description": "x" * 70_000}))}', "response_format"),
    ('"response_format": ' + json.dumps({"type": "regex", "regex": "a" * 5000}), "response_format"),
    ('"response_format": ' + json.dumps({"type": "ebnf", "ebnf": 'root ::= "a"' + " " * 70_000}), "response_format"),
    ('"structured_outputs": ' + json.dumps({"choice": [f"c{i}" for i in range(20_000)]}), "structured_outputs"),
    (f'"structured_outputs": {{"json": {nested_schema_text(70)}}}', "structured_outputs"),
    (f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": {nested_schema_text(70)}}}}}], "tool_choice": "required"', "tools.0.function.parameters"),
]  # fmt: skip


def test_a_constraint_past_a_limit_is_a_fast_400_naming_its_field_while_health_answers(m3_server):
    """Each limit: a 400 within 1 s naming the field, while ``/health`` polled every 20 ms answers
    within 200 ms; the server then serves a constrained request."""
    base = str(m3_server.base_url).removesuffix("/").removesuffix("/v1")
    latencies, done = [], threading.Event()

    def poll():
        with httpx.Client() as client:
            while not done.is_set():
                start = time.monotonic()
                assert client.get(base + "/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with httpx.Client(timeout=30) as client:
            for fields, param in PAST_A_LIMIT:
                body = f'{{"messages": {json.dumps(USER)}, "max_tokens": 4, {fields}}}'
                start = time.monotonic()
                reply = client.post(
                    base + "/v1/chat/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                )
                took = time.monotonic() - start
                error = reply.json()["error"]
                assert (reply.status_code, error["param"]) == (400, param), (fields[:80], error)
                assert "at most" in error["message"] or "deeper than" in error["message"], error
                assert took < 1.0, (fields[:80], took)
        time.sleep(0.2)  # (a few polls after the last, too)
    finally:
        done.set()
        poller.join()
    assert len(latencies) > 5 and max(latencies) < 0.2, max(latencies)
    reply = m3_server.chat.completions.create(
        model="m3", messages=USER, max_tokens=4, response_format={"type": "json_object"}
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    report = httpx.get(base + "/kv_cache").json()  # (its check_integrity runs too)
    managers = [v for v in report.values() if isinstance(v, dict)]
    held = sum(m["used"] + m["live_requests"] for m in managers)
    assert held + report["held_for_transfer"] + report["active_requests"] == 0, report
