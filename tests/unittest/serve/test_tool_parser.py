"""MiniMax-M3's tool parser on vectors of its markup: whole, and streamed in random pieces (a
namespace token or a tag cut anywhere), whose pieces must join to the whole result: the same
normal text, each call's name first, then its arguments' JSON text as growing prefixes."""

import json
import random
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorrt_llm.serve.tool_parser import (
    MiniMaxM3ToolParser,
    StreamingParseResult,
    ToolCallItem,
    ToolParserFactory,
)

NS = "]<]minimax[>["


def tag(name: str, inner: str) -> str:
    return f"{NS}<{name}>{inner}{NS}</{name}>"


def invoke(name: str, *params: str) -> str:
    return f'{NS}<invoke name="{name}">' + "".join(params) + f"{NS}</invoke>"


def block(*invokes: str) -> str:
    return f"{NS}<tool_call>\n" + "\n".join(invokes) + f"\n{NS}</tool_call>"


def tool(name: str, properties: dict | None = None) -> dict:
    schema = None if properties is None else {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


WEATHER = tool(
    "get_weather",
    {
        "city": {"type": "string"},
        "days": {"type": "array", "items": {"type": "integer"}},
        "zip": {"type": "string"},
        "metric": {"type": "boolean"},
        "limit": {"type": ["integer", "null"]},
        "ratio": {"type": "number"},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "tags": {"type": "array"}},
        },
        "options": {"type": "object"},
    },
)
TOOLS = [WEATHER, tool("get-time", {"time-zone": {"type": "string"}}), tool("free")]

# (reply, normal text, [(name, arguments)])
VECTORS = [
    (  # the published example: text, an array of items, typed by the schema
        "Checking. "
        + block(
            invoke(
                "get_weather",
                tag("city", "Paris"),
                tag("days", tag("item", "1") + tag("item", "2")),
            )
        ),
        "Checking. ",
        [("get_weather", {"city": "Paris", "days": [1, 2]})],
    ),
    (  # a string stays a string; integers, numbers, booleans, null and unions typed
        block(
            invoke(
                "get_weather",
                tag("zip", "007"),
                tag("metric", "true"),
                tag("limit", "null"),
                tag("ratio", "2.5"),
            )
        ),
        "",
        [("get_weather", {"zip": "007", "metric": True, "limit": None, "ratio": 2.5})],
    ),
    (  # nested objects and a nested array without a schema for its items
        block(
            invoke(
                "get_weather",
                tag(
                    "where", tag("lat", "48.85") + tag("tags", tag("item", "a") + tag("item", "b"))
                ),
                tag("options", '{"units": "si"}'),
            )
        ),
        "",
        [
            (
                "get_weather",
                {"where": {"lat": 48.85, "tags": ["a", "b"]}, "options": {"units": "si"}},
            )
        ],
    ),
    (  # a name repeated in a run is a list, at the top level and nested
        block(
            invoke("free", tag("x", "1"), tag("x", "2"), tag("o", tag("k", "a") + tag("k", "b")))
        ),
        "",
        [("free", {"x": ["1", "2"], "o": {"k": ["a", "b"]}})],
    ),
    (  # parallel calls, hyphens in names, markup-like text in a value kept as written
        block(
            invoke("get-time", tag("time-zone", "UTC+1")),
            invoke("free", tag("q", 'a <b>bold</b> & "quoted" </q>')),
        ),
        "",
        [("get-time", {"time-zone": "UTC+1"}), ("free", {"q": 'a <b>bold</b> & "quoted" </q>'})],
    ),
    (  # no arguments; an unknown tool's arguments stay text; text after the block
        block(invoke("free"), invoke("nobody", tag("n", "5"))) + " done",
        " done",
        [("free", {}), ("nobody", {"n": "5"})],
    ),
    (  # two blocks; whitespace around the markup
        "a" + block(invoke("free", tag("n", "1"))) + "b" + block(invoke("free")),
        "ab",
        [("free", {"n": "1"}), ("free", {})],
    ),
    (  # the block's closing tag never came, every call closed: the calls stand
        f"{NS}<tool_call>" + invoke("free", tag("n", "1")),
        "",
        [("free", {"n": "1"})],
    ),
    (
        "No tools needed: ]<] is not the namespace.",
        "No tools needed: ]<] is not the namespace.",
        [],
    ),
]


def pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        size = rng.randint(1, 9)
        out.append(text[i : i + size])
        i += size
    return out


def streamed(text: str, rng: random.Random) -> tuple[str, list[ToolCallItem]]:
    parser = ToolParserFactory.create_tool_parser("minimax_m3")
    results = [parser.parse_streaming_increment(p, TOOLS) for p in pieces(text, rng)]
    results.append(parser.finish(TOOLS))
    return "".join(r.normal_text for r in results), [c for r in results for c in r.calls]


def joined(items: list[ToolCallItem]) -> list[tuple[str, str]]:
    """Streamed pieces as whole calls: each call's name, then its arguments' pieces."""
    calls: dict[int, list] = {}
    for item in items:
        if item.name is not None:
            assert item.tool_index not in calls and item.parameters == ""  # the name comes first
            calls[item.tool_index] = [item.name, ""]
        else:
            calls[item.tool_index][1] += item.parameters
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize(("text", "normal", "calls"), VECTORS)
def test_vectors_whole_and_streamed(text, normal, calls):
    parser = ToolParserFactory.create_tool_parser("minimax_m3")
    whole = parser.detect_and_parse(text, TOOLS)
    assert whole.normal_text == normal
    assert [(c.name, json.loads(c.parameters)) for c in whole.calls] == calls
    assert [c.tool_index for c in whole.calls] == list(range(len(calls)))
    assert parser.has_tool_call(text) == bool(calls)
    rng = random.Random(zlib.crc32(text.encode()))
    for _ in range(12):
        text_out, items = streamed(text, rng)
        assert text_out == normal
        assert joined(items) == [(c.name, c.parameters) for c in whole.calls]


def test_the_name_goes_out_first_and_the_arguments_as_each_completes():
    parser = ToolParserFactory.create_tool_parser("minimax_m3")
    step = lambda text: parser.parse_streaming_increment(text, TOOLS)  # noqa: E731
    assert step("Sure. ]<]mini") == StreamingParseResult("Sure. ")  # (the namespace held)
    assert step(f'max[>[<tool_call>{NS}<invoke name="get_weather">') == StreamingParseResult(
        "", [ToolCallItem(0, "get_weather", ""), ToolCallItem(0, None, "{")]
    )
    assert step(tag("city", "Paris")).calls == []  # (it may still repeat)
    assert step(f"{NS}<days>").calls == [ToolCallItem(0, None, '"city": "Paris"')]
    assert step(tag("item", "3") + f"{NS}</days>").calls == []
    assert step(f"{NS}</invoke>").calls == [ToolCallItem(0, None, ', "days": [3]}')]
    assert step(f"\n{NS}</tool_call> ok") == StreamingParseResult(" ok")


@pytest.mark.parametrize(
    "text",
    [
        block(invoke("free", tag("n", "1"), "stray text", tag("m", "2"))),  # text between arguments
        f"{NS}<tool_call>" + f'{NS}<invoke name="free">' + tag("n", "1"),  # a call never closed
        f"{NS}<tool_call>{NS}not a tag at all",  # the namespace opening no tag
        f"{NS}<tool_call>\n",  # a block without a call
        block(
            invoke("free", tag("x", "1"), tag("y", "2"), tag("x", "3"))
        ),  # a repeat out of its run
        block(f'{NS}<invoke name="free">' + tag("n", "1") + f"{NS}</wrong>"),  # a stray closing tag
    ],
)
def test_malformed_markup_comes_back_as_text_never_an_error(text):
    whole = ToolParserFactory.create_tool_parser("minimax_m3").detect_and_parse(text, TOOLS)
    assert whole.calls == [] and whole.normal_text == text
    normal, items = streamed(text, random.Random(1))
    assert normal.endswith(text[text.index(NS) :][-20:])  # the markup's text comes back
    for _, arguments in joined(items):  # a call announced before the fault is closed whole
        json.loads(arguments)


def test_calls_closed_before_a_fault_stand():
    good = invoke("free", tag("n", "1"))
    bad = f'{NS}<invoke name="free">' + tag("n", "2") + "oops" + f"{NS}</invoke>"
    whole = ToolParserFactory.create_tool_parser("minimax_m3").detect_and_parse(
        f"{NS}<tool_call>{good}{bad}{NS}</tool_call>", TOOLS
    )
    assert [(c.name, json.loads(c.parameters)) for c in whole.calls] == [("free", {"n": "1"})]
    assert whole.normal_text.startswith(bad)


def test_an_unknown_parser_name_is_refused():
    with pytest.raises(ValueError, match="'hermes'.*minimax_m3"):
        ToolParserFactory.create_tool_parser("hermes")


def render(value) -> str:
    """``value`` in the markup, as a chat template writes a call's arguments."""
    if isinstance(value, dict):
        return "".join(tag(k, render(v)) for k, v in value.items())
    if isinstance(value, list):
        return "".join(tag("item", render(v)) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def schema_of(value) -> dict:
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: schema_of(v) for k, v in value.items()}}
    if isinstance(value, list):
        return {"type": "array", "items": schema_of(value[0])}
    return {"type": {bool: "boolean", int: "integer", str: "string"}[type(value)]}


NAMES = st.from_regex(r"[a-z][a-z0-9_-]{0,5}", fullmatch=True)
LEAVES = st.one_of(
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.text(alphabet="ab 7<>/&\"'\n", max_size=8),
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3).filter(
            lambda items: (
                len({type(v) for v in items}) == 1  # (one schema for the items)
                and not any(isinstance(v, list | dict) for v in items)
            )
        ),
        st.dictionaries(NAMES, inner, min_size=1, max_size=3),
    ),
    max_leaves=6,
)


@given(args=st.dictionaries(NAMES, VALUES, max_size=4), seed=st.integers(0, 2**16))
def test_any_arguments_written_in_the_markup_read_back_whole_and_streamed(args, seed):
    schema = schema_of(args) if args else {"type": "object", "properties": {}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    text = "pre " + block(invoke("f", render(args)))
    whole = MiniMaxM3ToolParser().detect_and_parse(text, tools)
    assert whole.normal_text == "pre "
    assert [(c.name, json.loads(c.parameters)) for c in whole.calls] == [("f", args)]
    parser, rng = MiniMaxM3ToolParser(), random.Random(seed)
    results = [parser.parse_streaming_increment(p, tools) for p in pieces(text, rng)]
    results.append(parser.finish(tools))
    assert joined([c for r in results for c in r.calls]) == [("f", whole.calls[0].parameters)]
