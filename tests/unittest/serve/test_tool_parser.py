"""MiniMax-M3's tool parser on vectors of its markup: whole, and streamed in random pieces (a
namespace token or a tag cut anywhere), whose pieces must join to the whole result: the same
normal text, each call's name first, then its arguments' JSON text as growing prefixes."""

import json
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm.bundled import BUNDLED_TARGET
from tensorrt_llm.serve.structured_output import tool_guide
from tensorrt_llm.serve.tool_parser import (
    MiniMaxM3ToolParser,
    StreamingParseResult,
    ToolCallItem,
    ToolParserFactory,
)
from tensorrt_llm.serve.tool_parser.minimax_m3_markup import (
    BLOCK_CLOSE,
    BLOCK_OPEN,
    check_tool_parameters,
    name_problem,
    unwritable_names,
)
from tensorrt_llm.tokenizer import render_chat_template

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


def cut_at(text: str, cuts) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


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


def streamed(parts: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    """The normal text and the calls of a reply streamed in ``parts``."""
    parser = ToolParserFactory.create_tool_parser("minimax_m3")
    results = [parser.parse_streaming_increment(p, tools) for p in parts]
    results.append(parser.finish(tools))
    return "".join(r.normal_text for r in results), joined([c for r in results for c in r.calls])


def whole(text: str, tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    found = ToolParserFactory.create_tool_parser("minimax_m3").detect_and_parse(text, tools)
    assert [c.tool_index for c in found.calls] == list(range(len(found.calls)))
    return found.normal_text, [(c.name, c.parameters) for c in found.calls]


def assert_streams_as_whole(text: str, tools=TOOLS) -> None:
    """Cut once at every point, one character at a time, and in random pieces, the stream reads
    to what the whole text reads to."""
    expected = whole(text, tools)
    for i in range(len(text) + 1):
        assert streamed(cut_at(text, [i]), tools) == expected, i
    assert streamed(list(text), tools) == expected
    rng = random.Random(zlib.crc32(text.encode()))
    for _ in range(4):
        assert streamed(pieces(text, rng), tools) == expected


@pytest.mark.parametrize(("text", "normal", "calls"), VECTORS)
def test_vectors_whole_and_streamed(text, normal, calls):
    normal_out, calls_out = whole(text)
    assert normal_out == normal
    assert [(name, json.loads(arguments)) for name, arguments in calls_out] == calls
    assert ToolParserFactory.create_tool_parser("minimax_m3").has_tool_call(text) == bool(calls)
    assert_streams_as_whole(text)


def test_a_call_goes_out_whole_once_its_invoke_closes_and_a_blocks_calls_one_by_one():
    parser = ToolParserFactory.create_tool_parser("minimax_m3")
    step = lambda text: parser.parse_streaming_increment(text, TOOLS)  # noqa: E731
    assert step("Sure. ]<]mini") == StreamingParseResult("Sure. ")  # (the namespace held)
    assert step(f'max[>[<tool_call>{NS}<invoke name="get_weather">') == StreamingParseResult()
    assert step(tag("city", "Paris") + tag("days", tag("item", "3"))).calls == []
    assert step(f"{NS}</invoke>\n").calls == [
        ToolCallItem(0, "get_weather", ""),
        ToolCallItem(0, None, '{"city": "Paris", "days": [3]}'),
    ]
    assert step(invoke("free") + "\n").calls == [
        ToolCallItem(1, "free", ""),
        ToolCallItem(1, None, "{}"),
    ]
    assert step(f"{NS}</tool_call> ok") == StreamingParseResult(" ok")
    assert parser.finish(TOOLS) == StreamingParseResult()


MALFORMED = [
    block(invoke("free", tag("n", "1"), "stray text", tag("m", "2"))),  # text between arguments
    f"{NS}<tool_call>" + f'{NS}<invoke name="free">' + tag("n", "1"),  # a call never closed
    f"{NS}<tool_call>{NS}not a tag at all",  # the namespace opening no tag
    f"{NS}<tool_call>\n",  # a block without a call
    block(),  # a closed block without a call
    block(invoke("free", tag("x", "1"), tag("y", "2"), tag("x", "3"))),  # a repeat out of its run
    block(f'{NS}<invoke name="free">' + tag("n", "1") + f"{NS}</wrong>"),  # a stray closing tag
    block(invoke("free", tag("o", "a" + tag("k", "b")))),  # text beside an element
    f"{NS}<tool_call>{NS}<>",  # an empty tag
    f"{NS}<tool_call>{NS}<invoke name=free>{NS}</invoke>",  # the name unquoted
    f"{NS}<tool_call>" + f"{NS}<d>" * 70 + f"{NS}</d>" * 70,  # nested past MAX_DEPTH
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_markup_comes_back_as_text_whole_and_streamed(text):
    assert whole(text) == (text, [])
    assert_streams_as_whole(text)


FREE_1 = invoke("free", tag("n", "1"))
CUT = f'{NS}<invoke name="get_weather">' + tag("city", "Rome")  # (a reply cut in a call)


@pytest.mark.parametrize(
    ("text", "normal", "calls"),
    [
        (f"a {NS}</invoke> b", f"a {NS}</invoke> b", []),  # outside a block
        (f"a {NS}</tool_call> b", f"a {NS}</tool_call> b", []),
        (f"a {FREE_1}", f"a {FREE_1}", []),  # an invoke outside a block
        (  # a stray closing tag after a call: the call stands, the rest is text
            f"{BLOCK_OPEN}\n{FREE_1}\n{NS}</invoke>\n{BLOCK_CLOSE}",
            f"{NS}</invoke>\n{BLOCK_CLOSE}",
            [("free", '{"n": "1"}')],
        ),
        (f"{BLOCK_OPEN}\n{CUT}", f"{BLOCK_OPEN}\n{CUT}", []),  # an invoke never closed
        (f"{BLOCK_OPEN}\n{FREE_1}\n{CUT}", CUT, [("free", '{"n": "1"}')]),
        (  # a block opened inside a block after a call: the first ends there
            f"{BLOCK_OPEN}{FREE_1} {BLOCK_OPEN}{FREE_1}{BLOCK_CLOSE}.",
            ".",
            [("free", '{"n": "1"}')] * 2,
        ),
    ],
)
def test_a_marker_that_opens_or_closes_nothing_stays_in_the_text(text, normal, calls):
    assert whole(text) == (normal, calls)
    assert_streams_as_whole(text)


def test_calls_closed_before_a_fault_stand_and_a_later_block_reads():
    good = invoke("free", tag("n", "1"))
    bad = f'{NS}<invoke name="free">' + tag("n", "2") + "oops" + f"{NS}</invoke>"
    text = f"{NS}<tool_call>{good}{bad}{NS}</tool_call> then " + block(invoke("get-time"))
    normal, calls = whole(text)
    assert calls == [("free", '{"n": "1"}'), ("get-time", "{}")]
    assert normal == f"{bad}{NS}</tool_call> then "
    assert_streams_as_whole(text)


FRAGMENTS = [
    "hi ",
    " ",
    "\n",
    "]<]",
    "<b>",
    NS,
    f"{NS}<",
    BLOCK_OPEN,
    BLOCK_CLOSE,
    f'{NS}<invoke name="free">',
    f"{NS}</invoke>",
    tag("n", "1"),
    tag("n", "2"),
    f"{NS}<n>",
    f"{NS}</n>",
    tag("k", tag("item", "a")),
    invoke("free", tag("n", "1")),
    invoke("get_weather", tag("days", tag("item", "4"))),
    "oops",
]


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=12),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_any_reply_streams_as_it_reads_whole_wherever_it_is_cut(parts, cuts):
    """No call goes out that the whole reply's reading would not report, and none is missed."""
    text = "".join(parts)
    expected = whole(text)
    for _, arguments in expected[1]:
        json.loads(arguments)
    assert streamed(cut_at(text, [c for c in cuts if c <= len(text)])) == expected
    assert streamed(list(text)) == expected


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


@settings(max_examples=40, deadline=None)
@given(args=st.dictionaries(NAMES, VALUES, max_size=4), seed=st.integers(0, 2**16))
def test_any_arguments_written_in_the_markup_read_back_whole_and_streamed(args, seed):
    schema = schema_of(args) if args else {"type": "object", "properties": {}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    text = "pre " + block(invoke("f", render(args)))
    found = MiniMaxM3ToolParser().detect_and_parse(text, tools)
    assert found.normal_text == "pre "
    assert [(c.name, json.loads(c.parameters)) for c in found.calls] == [("f", args)]
    rng = random.Random(seed)
    assert streamed(pieces(text, rng), tools) == ("pre ", [("f", found.calls[0].parameters)])


TEMPLATE = (BUNDLED_TARGET / "chat_template.jinja").read_text()
TRICKY = ["-n", "--flag", "a.b", "$x", "1st", "9", "a b", " a ", "é", "名前", "a<b", "<", "a/b"]
TRICKY += ["a</b", "x/", '"q"', "a\nb", "item", "invoke", "tool_call", 'invoke name="f"', "]<]mini"]
UNWRITABLE = ["", " ", "\t\n", "/x", "/", "a>b", ">", "</a>", f"a{NS}b"]
NAME_PIECES = st.one_of(
    st.sampled_from(["-", ".", "$", "0", " ", "<", ">", "/", "</", "é", "名", "\n", '"', "item"]),
    st.text(st.characters(codec="utf-8"), max_size=3),
)
PROPERTY_NAMES = st.lists(NAME_PIECES, max_size=4).map("".join)


def reply_of(arguments: dict) -> str:
    """An assistant turn calling ``f`` with ``arguments``, as the bundled chat template renders
    it (the reply's text, between the turn's opening and its end)."""
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": arguments}}],
        },
    ]
    text = render_chat_template(TEMPLATE, messages, False)
    return text[text.rindex("]~b]ai\n") + len("]~b]ai\n") : text.rindex("[e~[")]


def string_tool(names) -> list[dict]:
    properties = {name: {"type": "string"} for name in names}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(PROPERTY_NAMES, min_size=1, max_size=3, unique=True),
    numbers=st.lists(st.integers(-99, 99), min_size=3, max_size=3),
    cut=st.integers(0, 10_000),
)
def test_every_name_the_markup_carries_reads_back_from_the_template_whole_and_streamed(
    names, numbers, cut
):
    """Any property name a schema allows is either carried (rendered by the chat template, the
    reply parses back to the same call, whole and streamed) or refused where tools are offered."""
    names = [n for n in names if name_problem(n) is None] or ["-n"]
    args = {name: f"v{n} <b>/" for name, n in zip(names, numbers, strict=False)}
    tools = string_tool(names)
    text = reply_of(args)
    assert whole(text, tools) == ("", [("f", json.dumps(args, ensure_ascii=False))])
    assert streamed(cut_at(text, [cut % (len(text) + 1)]), tools) == whole(text, tools)
    assert streamed(list(text), tools) == whole(text, tools)


@pytest.mark.parametrize("name", TRICKY)
def test_names_like_command_line_flags_read_back(name):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {name: {"type": "integer"}, "o": {"type": "object"}},
                },
            },
        }
    ]
    args = {name: 3, "o": {name: "x", "k": ["1", "2"]}}
    assert whole(reply_of(args), tools) == ("", [("f", json.dumps(args, ensure_ascii=False))])


def structural_tag_takes(tools: list[dict], text: str) -> bool:
    """Whether the server's grammar for a call of ``f`` (``tool_choice`` naming it) takes
    ``text``; a ``ValueError`` (xgrammar's) when it cannot be built."""
    import xgrammar as xgr

    named = {"type": "function", "function": {"name": "f"}}
    guide = tool_guide(tools, named, "disabled")
    try:
        compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_structural_tag(
            guide.structural_tag
        )
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@settings(max_examples=20, deadline=None)
@given(name=st.one_of(st.sampled_from(TRICKY + UNWRITABLE), PROPERTY_NAMES))
def test_the_names_refused_are_those_xgrammars_structural_tag_refuses(name):
    """What ``tool_choice`` required or named builds (xgrammar's MiniMax-M3 structural tag) takes
    the template's rendering of every name the parser carries, and refuses the others."""
    tools = string_tool([name])
    if name_problem(name) is not None:
        with pytest.raises(ValueError, match="minimax_m3_xml element name"):
            structural_tag_takes(tools, "")
        with pytest.raises(ValueError, match="cannot be written"):
            check_tool_parameters(tools[0]["function"]["parameters"])
    else:
        assert structural_tag_takes(tools, reply_of({name: "v"}))


def test_a_tool_whose_property_name_the_markup_cannot_carry_is_refused_naming_it():
    from pydantic import ValidationError

    from tensorrt_llm.serve.errors import validation_message
    from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest

    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "object", "properties": {"-n": {}, "a>b": {"type": "string"}}}
        },
    }
    assert unwritable_names(schema) == [
        ("properties.ok.properties", "a>b", "it holds '>' (which ends a tag)")
    ]
    nested = {
        "type": "object",
        "$defs": {"d": {"properties": {"/x": {}}}},
        "anyOf": [{"properties": {"": {}}}],
        "properties": {"rows": {"items": {"properties": {" ": {}}}}},
    }
    assert [(p, n) for p, n, _ in unwritable_names(nested)] == [
        ("properties.rows.items.properties", " "),
        ("anyOf.0.properties", ""),
        ("$defs.d.properties", "/x"),
    ]
    tools = [tool("fine", {"-n": {}}), tool("bad", schema["properties"])]
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    assert validation_message(errors) == (
        "tools.1.function.parameters",
        "tools.1.function.parameters: the property name 'a>b' (at properties.ok.properties) "
        "cannot be written in MiniMax-M3's tool-call markup: it holds '>' (which ends a tag)",
    )
