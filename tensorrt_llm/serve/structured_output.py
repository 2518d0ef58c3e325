"""What a request's output must match (the engine's guided decoding), from its OpenAI fields.

- ``response_format``: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}}``, ``{"type": "structural_tag", ...}`` (xgrammar's
  structural tag), and upstream's ``{"type": "regex", "regex": ...}`` and ``{"type": "ebnf",
  "ebnf": ...}``.
- vLLM's ``structured_outputs`` body field: one of ``json``, ``regex``, ``choice`` (a list of
  strings), ``grammar``, ``json_object``, ``structural_tag``, and ``disable_any_whitespace``
  (which also applies to a ``response_format``'s JSON).
- ``tool_choice: "required"`` or a named function (and, under ``auto``, tools marked ``strict``):
  the M3 tool-call markup of the offered tools (of the named one), each call's arguments held to
  its parameters' schema (xgrammar's MiniMax-M3 structural tag); the model still picks the values.
  Under ``required`` and a named tool the block comes at once (after any reasoning): no text
  before it, so the call is made however weak the model.

When the server reads reasoning (``--reasoning_parser``), a ``response_format`` applies after
the reasoning block: the output may first reason, as the rendered prompt leaves it to (inside a
block it opened, a block the model may open, or none). Tool-call markup always follows the
prompt's mode: it is the model's own format.
"""

from __future__ import annotations

import json
from dataclasses import replace

from tensorrt_llm._torch.pyexecutor.grammar_matcher import MAX_WHITESPACE, json_schema_ebnf
from tensorrt_llm.llmapi.reasoning_parser import ThinkBlockParser
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParamsError
from tensorrt_llm.serve.grammar_limits import check_choices, check_constraint

FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag", "regex", "ebnf")
# the reasoning modes of xgrammar's model structural tags, by the template's thinking_mode
_XGRAMMAR_REASONING = {"enabled": "enabled", "disabled": "disabled", "adaptive": "auto"}


PARAM = "structured_outputs"


class FormatError(ValueError):
    """A request field that cannot constrain the output (the server's 400 names ``param``)."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


def _bad(message: str, param: str = "response_format") -> FormatError:
    return FormatError(message, param)


def response_guide(response_format: dict | None) -> GuidedDecodingParams | None:
    """The constraint of an OpenAI ``response_format`` (None for text); a 400 naming
    ``response_format`` for one that cannot be read."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind not in FORMAT_TYPES:
        raise _bad(f"response_format.type={kind!r}: expected one of {list(FORMAT_TYPES)}")

    def field(name: str, types):
        value = response_format.get(name)
        if not isinstance(value, types) or not value:
            raise _bad(f"response_format.type={kind!r} needs response_format.{name}")
        return value

    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return GuidedDecodingParams(json_object=True)
        if kind == "json_schema":
            spec = field("json_schema", dict)
            schema = spec.get("schema", spec.get("json_schema"))
            if not isinstance(schema, dict | bool):
                raise _bad("response_format.json_schema.schema must be a JSON schema (an object)")
            check_constraint("json", schema, "response_format.json_schema.schema")
            return GuidedDecodingParams(json=json.dumps(schema))
        if kind == "regex":
            regex = field("regex", str)
            check_constraint("regex", regex, "response_format.regex")
            return GuidedDecodingParams(regex=regex)
        if kind == "ebnf":
            ebnf = field("ebnf", str)
            check_constraint("grammar", ebnf, "response_format.ebnf")
            return GuidedDecodingParams(grammar=ebnf)
        field("format", dict)
        check_constraint("structural_tag", response_format, "response_format")
        return GuidedDecodingParams(structural_tag=json.dumps(response_format))
    except SamplingParamsError as exc:
        raise _bad(f"response_format: {exc}") from None


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def constraint_field(options: dict | None) -> str:
    """The request field that carries the constraint (what an error about it names):
    ``structured_outputs`` when it sets one, else ``response_format``."""
    sets = options is not None and any(options.get(k) not in (None, False) for k in STRUCTURED_KEYS)
    return PARAM if sets else "response_format"


def structured_guide(
    options: dict | None, response: GuidedDecodingParams | None
) -> GuidedDecodingParams | None:
    """vLLM's ``structured_outputs`` over ``response_format``'s constraint (``response``): its own
    constraint, or its ``disable_any_whitespace`` for the response's JSON. A 400 naming
    ``structured_outputs`` for one that cannot be read, or for two constraints at once."""
    if options is None:
        return response
    bad = sorted(set(options) - {*STRUCTURED_KEYS, "disable_any_whitespace"})
    if bad:
        keys = ", ".join((*STRUCTURED_KEYS, "disable_any_whitespace"))
        raise _bad(f"structured_outputs: unknown {', '.join(bad)} (it takes {keys})", PARAM)
    compact = options.get("disable_any_whitespace", False)
    given = {k: v for k, v in options.items() if k in STRUCTURED_KEYS and v not in (None, False)}
    if len(given) > 1 or (given and response is not None):
        named = [*given, *(["response_format"] if response is not None else [])]
        raise _bad(f"structured_outputs: one constraint at a time; got {', '.join(named)}", PARAM)
    if not given and (response is None or response.kind not in ("json", "json_object")):
        return response
    kind, value = next(iter(given.items()), (None, None))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _bad("structured_outputs.choice must be a list of strings", PARAM)
        check_choices(value, f"{PARAM}.choice")
        kind, value = "grammar", "root ::= " + " | ".join(json.dumps(c) for c in value)
    elif kind is not None:
        check_constraint(kind, value, f"{PARAM}.{kind}")
    try:
        if kind is None:  # (the response's JSON, laid out as asked)
            return replace(response, disable_any_whitespace=compact)
        if kind == "structural_tag":  # (its JSON read here: a 400 naming this field)
            tag = json.loads(value) if isinstance(value, str) else value
            if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
                raise ValueError("structural_tag must be an object with a format (an object)")
        return GuidedDecodingParams(**{kind: value}, disable_any_whitespace=compact)
    except ValueError as exc:  # (SamplingParamsError and JSON's errors among them)
        raise _bad(f"structured_outputs: {exc}", PARAM) from None


def _format_of(guide: GuidedDecodingParams) -> dict:
    """A constraint as a structural tag's format."""
    if guide.kind in ("json", "json_object"):
        schema = json.loads(guide.json) if guide.kind == "json" else {"type": "object"}
        if guide.disable_any_whitespace:  # (a tag's json_schema always allows whitespace)
            return {"type": "grammar", "grammar": json_schema_ebnf(json.dumps(schema))}
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
    if guide.kind == "regex":
        return {"type": "regex", "pattern": guide.regex}
    if guide.kind == "grammar":
        return {"type": "grammar", "grammar": guide.grammar}
    return json.loads(guide.structural_tag)["format"]


def after_reasoning(
    guide: GuidedDecodingParams, parser: type[ThinkBlockParser], mode: str
) -> GuidedDecodingParams:
    """``guide`` from the end of the reasoning block on, as a structural tag: in ``enabled`` mode
    the output starts inside the block (the prompt opened it), in ``adaptive`` mode it may open
    one or write a bare end marker first, in ``disabled`` mode the constraint starts at once."""
    if mode == "disabled":
        return guide
    reasoning = {"type": "any_text", "excludes": [parser.START, parser.END]}
    block = {"type": "tag", "begin": "", "content": reasoning, "end": parser.END}
    if mode == "adaptive":
        opened = {**block, "begin": parser.START}
        bare = {"type": "const_string", "value": parser.END}
        block = {"type": "optional", "content": {"type": "or", "elements": [opened, bare]}}
    tag = {
        "type": "structural_tag",
        "format": {"type": "sequence", "elements": [block, _format_of(guide)]},
    }
    return GuidedDecodingParams(structural_tag=json.dumps(tag))


def tool_guide(tools: list[dict], tool_choice, mode: str) -> GuidedDecodingParams | None:
    """The M3 tool-call markup that ``tool_choice`` requires (``required``, or a named function),
    or, under ``auto``, that calls to tools marked ``strict`` must follow once the model opens a
    call (None: nothing to enforce). ``tools``: the request's, as OpenAI sends them."""
    import xgrammar as xgr

    if tool_choice in (None, "auto"):
        if not any(t["function"].get("strict") for t in tools):
            return None
        # (the markup has no form for "any arguments": a call of a tool that is not strict
        # follows its parameters' schema too, once a strict tool is offered beside it)
        tool_choice = "auto"
    tag = xgr.get_model_structural_tag(
        "minimax_m3",
        tools=tools,
        tool_choice=tool_choice,
        reasoning=_XGRAMMAR_REASONING[mode],
        max_whitespace_cnt=MAX_WHITESPACE,
    )
    if tool_choice == "required":  # the calls at once, as a named tool's: no text before them
        sequence = tag.format if tag.format.type == "sequence" else None
        triggered = sequence.elements[-1] if sequence is not None else tag.format
        calls = triggered.tags[0]  # the tool-call block, one or more invokes
        if sequence is not None:
            sequence.elements[-1] = calls
        else:
            tag.format = calls
    return GuidedDecodingParams(structural_tag=tag.model_dump_json())
