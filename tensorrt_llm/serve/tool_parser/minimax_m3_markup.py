"""MiniMax-M3's tool-call markup, read into calls, and their arguments typed by the tools' schemas.

Every structural tag is the namespace token ``]<]minimax[>[`` followed by ``<tag ...>`` or
``</tag>``; text between tags is a value, taken as it is (markup-like text in a value, ``<b>``
without the namespace, stays text)::

    NS<tool_call>
    NS<invoke name="get_weather">NS<city>ParisNS</city>NS<days>NS<item>1NS</item>NS</days>NS</invoke>
    NS</tool_call>

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
_TAG = re.compile(r'<(/?)([A-Za-z_][\w.\-]*)((?:\s+[A-Za-z_][\w.\-]*="[^"]*")*)\s*>')
_ATTR = re.compile(r'([A-Za-z_][\w.\-]*)="([^"]*)"')


class Malformed(Exception):
    def __init__(self, at: int) -> None:
        super().__init__(f"malformed tool-call markup at {at}")
        self.at = at


@dataclass
class _Tag:
    closing: bool
    name: str
    attrs: dict[str, str]
    start: int
    end: int


@dataclass
class _Text:
    text: str
    start: int


def _tokens(body: str, final: bool) -> list[_Tag | _Text]:
    """The tags and texts of ``body`` as far as they are known (a tag or a namespace token still
    arriving is left out unless ``final``); ``Malformed`` where a namespace token opens no tag."""
    out: list[_Tag | _Text] = []
    i = 0
    while i < len(body):
        j = body.find(NS, i)
        if j < 0:
            end = len(body) - (0 if final else held_back(body[i:], (NS,)))
            if end > i:
                out.append(_Text(body[i:end], i))
            return out
        if j > i:
            out.append(_Text(body[i:j], i))
        match = _TAG.match(body, j + len(NS))
        if match is None:
            if not final and ">" not in body[j + len(NS) :]:
                return out  # (the tag is still arriving)
            raise Malformed(j)
        attrs = dict(_ATTR.findall(match.group(3)))
        out.append(_Tag(match.group(1) == "/", match.group(2), attrs, j, match.end()))
        i = match.end()
    return out


@dataclass
class Element:
    name: str
    start: int
    texts: list[str] = field(default_factory=list)
    children: list[Element] = field(default_factory=list)


def _element(tokens: list, k: int) -> tuple[Element | None, int]:
    """The element whose opening tag is ``tokens[k]`` and the index after it; None (and the end
    of ``tokens``) while its closing tag has not arrived."""
    opening = tokens[k]
    node = Element(opening.name, opening.start)
    k += 1
    while k < len(tokens):
        token = tokens[k]
        if isinstance(token, _Text):
            node.texts.append(token.text)
            k += 1
        elif not token.closing:
            child, k = _element(tokens, k)
            if child is None:
                return None, k
            node.children.append(child)
        elif token.name == node.name:
            return node, k + 1
        else:
            raise Malformed(token.start)
    return None, k


@dataclass
class Invoke:
    name: str
    start: int  # in the block's body
    params: list[Element] = field(default_factory=list)
    closed: bool = False
    reading: str | None = None  # the argument whose element is still arriving


@dataclass
class BlockRead:
    invokes: list[Invoke]
    closed: bool = False  # the block's closing tag read
    end: int = 0  # after the closing tag
    malformed_at: int | None = None


def read_block(body: str, final: bool) -> BlockRead:
    """The invokes of a block's ``body`` (the text after its opening tag) as far as known."""
    read = BlockRead([])
    try:
        tokens = _tokens(body, final)
        k = 0
        while k < len(tokens):
            token = tokens[k]
            if isinstance(token, _Text):
                k = _between(token, k)
            elif token.closing and token.name == "tool_call":
                read.closed, read.end = True, token.end
                return read
            elif token.closing or token.name != "invoke" or "name" not in token.attrs:
                raise Malformed(token.start)
            else:
                invoke = Invoke(token.attrs["name"], token.start)
                read.invokes.append(invoke)
                k = _arguments(tokens, k + 1, invoke)
    except Malformed as bad:
        read.malformed_at = bad.at
    return read


def _between(token: _Text, k: int) -> int:
    """Text between elements: whitespace is passed over (the index after it); any other text
    there is malformed."""
    if token.text.strip():
        raise Malformed(token.start)
    return k + 1


def _arguments(tokens: list, k: int, invoke: Invoke) -> int:
    while k < len(tokens):
        token = tokens[k]
        if isinstance(token, _Text):
            k = _between(token, k)
        elif token.closing:
            if token.name != "invoke":
                raise Malformed(token.start)
            invoke.closed = True
            return k + 1
        else:
            node, k = _element(tokens, k)
            if node is None:
                invoke.reading = token.name
                return k
            invoke.params.append(node)
    return k


def arguments(params: list[Element], schema: dict | None) -> dict:
    """An invoke's arguments, typed by the tool's ``parameters`` schema."""
    names = [p.name for p in params]
    for i, name in enumerate(names):  # (a repeat only in a run: the streamed JSON stays a prefix)
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
