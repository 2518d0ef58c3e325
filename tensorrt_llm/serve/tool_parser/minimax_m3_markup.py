"""MiniMax-M3's tool-call markup, read into calls, and their arguments typed by the tools' schemas.

Every structural tag is the namespace token ``]<]minimax[>[`` followed by ``<NAME>`` or
``</NAME>``; text between tags is a value, taken as it is (markup-like text in a value, ``<b>``
without the namespace, stays text)::

    NS<tool_call>
    NS<invoke name="get_weather">NS<city>ParisNS</city>NS<days>NS<item>1NS</item>NS</days>NS</invoke>
    NS</tool_call>

A tag's name is everything between ``<`` (or ``</``) and the first ``>``: the chat template
writes an argument's name as it is, so ``-n``, ``a.b``, ``$x``, ``1st``, ``a b`` or ``名前`` are
names like any other. A name cannot be told apart in the markup when it is empty, starts with
``/`` (``NS</x>`` closes ``x``) or holds ``>`` (which ends the tag); xgrammar's ``minimax_m3_xml``
(the grammar of ``tool_choice`` required or named) refuses those and blank names too. The server
refuses a tool with any of them (``check_tool_parameters``, a 400 naming
``tools.N.function.parameters``) rather than offer the model a name it cannot write back.

A block holds one or more ``invoke`` (parallel calls); an invoke's elements are its arguments.
An element with child elements is an array (its schema says so, or, without one, every child is
an ``item``) or an object (children by name; a name repeated makes a list). Leaf text is typed by
the argument's schema (``coerce``): a ``string`` stays the text even when it looks like a number;
without a schema it stays text. At an invoke's top level a name may repeat only in a run (a list);
the same name again later is malformed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from tensorrt_llm.llmapi.reasoning_parser import held_back

NS = "]<]minimax[>["
BLOCK_OPEN, BLOCK_CLOSE = f"{NS}<tool_call>", f"{NS}</tool_call>"
_INVOKE = re.compile(r'invoke\s+name="([^"]*)"\s*')
_ASCII_WHITESPACE = " \t\n\r\x0b\x0c"
MAX_DEPTH = 64  # elements nested deeper are malformed (the reading is not recursive; typing is)
# schema keywords whose values are schemas, lists of schemas, or maps of names to schemas
_SUBSCHEMA = ("additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")  # (items: one or a list)
_SUBSCHEMA_MAPS = ("$defs", "definitions", "patternProperties", "dependentSchemas")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an element's name in the markup; None when it can."""
    if not name:
        return "it is empty"
    if not name.strip(_ASCII_WHITESPACE):
        return "it is blank"
    if name.startswith("/"):
        return "it starts with '/' (the markup would read a closing tag)"
    if ">" in name:
        return "it holds '>' (which ends a tag)"
    return None


def unwritable_names(schema, path: str = "") -> list[tuple[str, str, str]]:
    """``(path, name, why)`` of each property name in the JSON ``schema`` that the markup cannot
    carry (``name_problem``), at any depth; ``path`` is the dotted place of its ``properties``
    (``properties.where.properties``)."""
    if not isinstance(schema, dict):
        return []
    out = []
    at = f"{path}." if path else ""
    properties = schema.get("properties")
    if isinstance(properties, dict):
        for name, sub in properties.items():
            why = name_problem(name)
            if why is not None:
                out.append((f"{at}properties", name, why))
            elif isinstance(sub, dict):
                out += unwritable_names(sub, f"{at}properties.{name}")
    for key in _SUBSCHEMA:
        out += unwritable_names(schema.get(key), f"{at}{key}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                out += unwritable_names(sub, f"{at}{key}.{i}")
        else:
            out += unwritable_names(schema.get(key), f"{at}{key}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                out += unwritable_names(sub, f"{at}{key}.{name}")
    return out


def check_tool_parameters(schema: dict | None) -> None:
    """A ``ValueError`` naming the first property name of a tool's ``parameters`` schema that the
    markup cannot carry: the model could not write it, nor the parser read it back."""
    bad = unwritable_names(schema)
    if bad:
        path, name, why = bad[0]
        raise ValueError(
            f"the property name {name!r} (at {path}) cannot be written in MiniMax-M3's "
            f"tool-call markup: {why}"
        )


class Malformed(Exception):
    def __init__(self, at: int) -> None:
        super().__init__(f"malformed tool-call markup at {at}")
        self.at = at


@dataclass
class _Tag:
    closing: bool
    name: str
    start: int
    end: int


@dataclass
class _Text:
    text: str
    start: int


def _tokens(body: str, final: bool) -> tuple[list[_Tag | _Text], int | None]:
    """The tags and texts of ``body`` as far as they are known (a tag or a namespace token still
    arriving is left out unless ``final``), and where a namespace token opens no tag (None: none
    does): the tokens stop there."""
    out: list[_Tag | _Text] = []
    i = 0
    while i < len(body):
        j = body.find(NS, i)
        if j < 0:
            end = len(body) - (0 if final else held_back(body[i:], (NS,)))
            if end > i:
                out.append(_Text(body[i:end], i))
            return out, None
        if j > i:
            out.append(_Text(body[i:j], i))
        lt = j + len(NS)
        gt = body.find(">", lt)
        if body[lt : lt + 1] not in ("<", "") or (gt < 0 and final):
            return out, j
        if gt < 0:
            return out, None  # (the tag is still arriving)
        closing = body.startswith("/", lt + 1)
        name = body[lt + 1 + closing : gt]
        if not name:
            return out, j
        out.append(_Tag(closing, name, j, gt + 1))
        i = gt + 1
    return out, None


@dataclass
class Element:
    name: str
    start: int
    texts: list[str] = field(default_factory=list)
    children: list[Element] = field(default_factory=list)


@dataclass
class Invoke:
    name: str
    start: int  # where its tag starts, in the text read
    end: int = 0  # after its closing tag; 0 while it is open
    params: list[Element] = field(default_factory=list)


@dataclass
class BlockRead:
    """A block's text read as far as it is known: its invokes in order (each closed but perhaps
    the last), where its closing tag ends once read, and where the markup stops reading."""

    invokes: list[Invoke]
    end: int | None = None
    fault: int | None = None


def read_block(body: str, final: bool) -> BlockRead:
    """The invokes of ``body``, the text of a block after its opening tag or after a call of it
    (whitespace may lie between invokes; anything else there is a fault)."""
    read = BlockRead([])
    tokens, unreadable = _tokens(body, final)
    try:
        k = 0
        while k < len(tokens):
            token = tokens[k]
            if isinstance(token, _Text):
                if token.text.strip():
                    raise Malformed(token.start)
                k += 1
            elif token.closing and token.name == "tool_call":
                read.end = token.end
                return read
            elif token.closing or _INVOKE.fullmatch(token.name) is None:
                raise Malformed(token.start)
            else:
                invoke = Invoke(_INVOKE.fullmatch(token.name).group(1), token.start)
                read.invokes.append(invoke)
                k = _arguments(tokens, k + 1, invoke)
        read.fault = unreadable
    except Malformed as bad:
        read.fault = bad.at
    return read


def _arguments(tokens: list, k: int, invoke: Invoke) -> int:
    """Reads an invoke's elements from ``tokens[k]`` to its closing tag (setting ``end``) or to
    the end of ``tokens``; the index after."""
    open_: list[Element] = []  # the elements opened and not closed, outermost first
    while k < len(tokens):
        token = tokens[k]
        k += 1
        if isinstance(token, _Text):
            if open_:
                open_[-1].texts.append(token.text)
            elif token.text.strip():
                raise Malformed(token.start)  # (text between arguments)
        elif not token.closing:
            if len(open_) == MAX_DEPTH:
                raise Malformed(token.start)
            node = Element(token.name, token.start)
            (open_[-1].children if open_ else invoke.params).append(node)
            open_.append(node)
        elif open_ and token.name == open_[-1].name:
            open_.pop()
        elif not open_ and token.name == "invoke":
            invoke.end = token.end
            return k
        else:
            raise Malformed(token.start)
    return k


def arguments(params: list[Element], schema: dict | None) -> dict:
    """An invoke's arguments, typed by the tool's ``parameters`` schema."""
    names = [p.name for p in params]
    for i, name in enumerate(names):
        if i and name != names[i - 1] and name in names[:i]:
            raise Malformed(params[i].start)
    return _by_name(params, (schema or {}).get("properties") or {})


def _by_name(children: list[Element], properties: dict) -> dict:
    grouped: dict[str, list[Element]] = {}
    for child in children:
        grouped.setdefault(child.name, []).append(child)
    out = {}
    for name, nodes in grouped.items():
        schema = properties.get(name)
        if len(nodes) == 1:
            out[name] = value(nodes[0], schema)
        else:
            items = schema.get("items") if isinstance(schema, dict) else None
            out[name] = [value(node, items) for node in nodes]
    return out


def value(node: Element, schema: dict | None):
    """An element's value: its children's (array or object), else its text typed by
    ``schema``."""
    if not node.children:
        return coerce("".join(node.texts), schema)
    if any(text.strip() for text in node.texts):
        raise Malformed(node.start)  # (text beside child elements)
    kinds = _types(schema)
    if "array" in kinds or (not kinds and all(c.name == "item" for c in node.children)):
        items = schema.get("items") if isinstance(schema, dict) else None
        return [value(child, items) for child in node.children]
    return _by_name(node.children, (schema or {}).get("properties") or {})


def _types(schema) -> list[str]:
    """The JSON types ``schema`` allows, in its order (``type``, ``anyOf``/``oneOf``)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [k for sub in schema[key] for k in _types(sub)]
    return ["object"] if "properties" in schema else []


def coerce(text: str, schema: dict | None):
    """``text`` as the first of ``schema``'s types it can be (``null`` tried first: a value that
    may be a string or null written ``null`` is null); the text itself when none fits or there
    is no schema."""
    word = text.strip()
    kinds = _types(schema)
    for kind in sorted(kinds, key=lambda k: k != "null"):
        if kind == "string":
            return text
        if kind == "integer" and re.fullmatch(r"[-+]?\d+", word):
            return int(word)
        if kind == "number":
            try:
                number = float(word)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(word) if re.fullmatch(r"[-+]?\d+", word) else number
        if kind == "boolean" and word.lower() in ("true", "false"):
            return word.lower() == "true"
        if kind == "null" and word.lower() in ("null", "none"):
            return None
        if kind in ("object", "array"):
            try:
                decoded = json.loads(word)
            except json.JSONDecodeError:
                continue
            if isinstance(decoded, dict if kind == "object" else list):
                return decoded
    return text
