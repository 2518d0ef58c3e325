"""How large a constraint one request may bring, checked before any grammar is built: a grammar's
cost grows faster than its schema's nesting, so a 25 KB schema nested 400 deep takes seconds
to build (and past about 480 levels Python's own JSON writer gives up). Each check raises
``ValueError`` with a message that names the request's field and the limit; the request models'
validators turn it into a 400 naming the field.

What the limits bound (a constraint within all of them builds in well under a second):

- ``MAX_JSON_DEPTH``: objects and arrays inside one another, in a JSON schema or a structural
  tag. A schema nests two levels per nested object (the object, its ``properties``), so 128
  allows 64 nested schemas;
- ``MAX_JSON_VALUES``: the values of one such document (or of a past tool call's arguments),
  which bounds the walk that checks it;
- ``MAX_PROPERTIES``: property names of every object of a schema together;
- ``MAX_ENUM_VALUES``: ``enum`` values of every schema together;
- ``MAX_CONSTRAINT_BYTES``: a schema's, an EBNF grammar's or a structural tag's text;
- ``MAX_REGEX_CHARS``: a regular expression;
- ``MAX_CHOICE_STRINGS``: the strings of ``structured_outputs.choice``.
"""

from __future__ import annotations

import json

MAX_JSON_DEPTH = 128
MAX_JSON_VALUES = 32768
MAX_PROPERTIES = 1024
MAX_ENUM_VALUES = 1024
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICE_STRINGS = 256


def check_json(value, name: str) -> None:
    """``value`` (a JSON document as Python objects) within the depth, property and enum limits;
    ``name``: the request field it came in, for the message. Walked without recursion, so any
    depth is measured."""
    properties = enum_values = walked = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        walked += 1
        if walked > MAX_JSON_VALUES:
            raise ValueError(f"{name} holds more than {MAX_JSON_VALUES} values")
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(
                f"{name} nests objects and arrays deeper than {MAX_JSON_DEPTH} levels (about "
                f"{MAX_JSON_DEPTH // 2} nested schemas)"
            )
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            if isinstance(node.get("enum"), list):
                enum_values += len(node["enum"])
        stack.extend((child, depth + 1) for child in children)
    if properties > MAX_PROPERTIES:
        raise ValueError(f"{name} has {properties} properties; at most {MAX_PROPERTIES}")
    if enum_values > MAX_ENUM_VALUES:
        raise ValueError(f"{name} has {enum_values} enum values; at most {MAX_ENUM_VALUES}")


def check_size(text: str, name: str, limit: int = MAX_CONSTRAINT_BYTES) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ValueError(f"{name} is {size} bytes; at most {limit}")


def check_json_text(text: str, name: str) -> None:
    """JSON text (a schema or a structural tag as a string) within the size limit, then its
    document within ``check_json``'s (text that is not JSON is left to the grammar's own
    error)."""
    check_size(text, name)
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(
            f"{name} nests objects and arrays deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    except ValueError:
        return
    check_json(value, name)


def check_constraint(kind: str, value, name: str) -> None:
    """A constraint of ``kind`` (``GuidedDecodingParams``' names: ``json``, ``regex``,
    ``grammar``, ``structural_tag``) as the request gave it (text, or a JSON document as Python
    objects) within the limits; ``name``: its field."""
    if not isinstance(value, str):
        if kind in ("json", "structural_tag"):
            check_json(value, name)
            check_size(json.dumps(value), name)
        return
    if kind == "regex":
        if len(value) > MAX_REGEX_CHARS:
            raise ValueError(f"{name} is {len(value)} characters; at most {MAX_REGEX_CHARS}")
    elif kind in ("json", "structural_tag"):
        check_json_text(value, name)
    else:
        check_size(value, name)


def check_choices(choices: list[str], name: str) -> None:
    if len(choices) > MAX_CHOICE_STRINGS:
        raise ValueError(f"{name} has {len(choices)} strings; at most {MAX_CHOICE_STRINGS}")
    check_size("".join(choices), name)
