"""A chat request's messages and tools: text and image parts, assistant turns with their
reasoning and tool calls, tool results, and the tools a model may call (``openai_protocol.py``
re-exports them)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from tensorrt_llm.serve.grammar_limits import MAX_JSON_DEPTH, check_json
from tensorrt_llm.serve.tool_parser.minimax_m3_markup import check_tool_parameters


def _encodable(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise ValueError(f"holds a lone surrogate (U+{code:04X}) at {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]  # every string a request carries


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: Text


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="ignore")  # "detail": the processor sizes every image alike

    url: Text


class ImageUrlPart(OpenAIBaseModel):
    """An image: a ``data:`` URL, an ``http(s)`` URL, or ``file://`` under the server's
    ``--allowed-local-media-path`` (``serve/media.py``)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Text
    # what the model passed: clients send it back as JSON text; the template renders an object
    arguments: Text | dict = "{}"

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, value):
        if isinstance(value, dict):
            check_json(value, "arguments")
            return value
        try:
            decoded = json.loads(value or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not JSON ({exc.msg} at {exc.pos})") from None
        except RecursionError:
            raise ValueError(
                f"nests objects and arrays deeper than {MAX_JSON_DEPTH} levels"
            ) from None
        check_json(decoded, "arguments")
        if not isinstance(decoded, dict):
            raise ValueError("must be a JSON object of the arguments")
        return decoded


class ToolCall(BaseModel):
    """A call an assistant message made (the history of a tool round trip)."""

    model_config = ConfigDict(extra="ignore")

    id: Text | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """A message: text, or a list of text and image parts. An assistant message may carry its
    reasoning (``reasoning_content``, kept in the history) and the calls it made
    (``tool_calls``, its content then optional); a ``tool`` message is a call's result."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]] | None = (
        None
    )
    reasoning_content: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    name: Text | None = None

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.role != "assistant":
            extra = [f for f in ("reasoning_content", "tool_calls") if getattr(self, f)]
            if extra:
                raise ValueError(f"{extra[0]} belongs to an assistant message, not {self.role!r}")
            if self.content is None:
                raise ValueError(f"a {self.role!r} message needs content")
        elif self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def text(self, image_mark: str = "") -> str:
        """The content as text, each image part written as ``image_mark``."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else image_mark for p in self.content)

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageUrlPart)]

    def for_template(self, image_mark: str = "") -> dict:
        """The message as a chat template reads it (tool call arguments as objects)."""
        out: dict = {"role": self.role, "content": self.text(image_mark)}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def texts(self, index: int) -> list[tuple[str, str]]:
        """``(param, text)`` of every text of it that reaches the prompt."""
        where = f"messages.{index}"
        out = [(f"{where}.content", self.text())]
        if self.reasoning_content:
            out.append((f"{where}.reasoning_content", self.reasoning_content))
        for key in ("name", "tool_call_id"):
            if getattr(self, key):
                out.append((f"{where}.{key}", getattr(self, key)))
        for j, call in enumerate(self.tool_calls or ()):
            arguments = json.dumps(call.function.arguments, ensure_ascii=False)
            out.append((f"{where}.tool_calls.{j}.function.name", call.function.name))
            out.append((f"{where}.tool_calls.{j}.function.arguments", arguments))
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema of an object: its arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, schema):
        if schema is None:
            return schema
        check_json(schema, "parameters")
        if schema.get("type", "object") != "object":
            raise ValueError(f"must be a schema of an object, not of type {schema['type']!r}")
        properties = schema.get("properties", {})
        if not isinstance(properties, dict) or not all(
            isinstance(p, dict) for p in properties.values()
        ):
            raise ValueError("properties must map each argument's name to its schema")
        check_tool_parameters(schema)  # (names the tool-call markup can carry)
        return schema


class ChatCompletionToolsParam(BaseModel):
    """A tool the model may call (upstream's name)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class _ToolName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function the reply must call."""

    type: Literal["function"] = "function"
    function: _ToolName
