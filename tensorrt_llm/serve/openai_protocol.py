"""OpenAI-compatible request and response bodies (the subset this server implements)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams
from tensorrt_llm.llmapi.reasoning_parser import THINKING_MODES

MAX_CHOICES = 16  # choices of one request: prompts times n


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


# Fields clients send that would change the result if ignored: refused (a 400 naming the field)
# unless they ask for the default. Any other unknown field is ignored with a logged warning.
_UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "echo": (None, False),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
}


class _SamplingFields(BaseModel):
    """A request body: unknown fields are kept aside (``model_extra``) for the server to log."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    # Strict: `true` is not a max_tokens and "yes" is not a stream flag.
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)  # samples per prompt
    user: Text | None = None
    ignore_eos: StrictBool = False
    # Disaggregated serving: {"request_type": "context_only"} asks a context server to prefill and
    # keep the KV; a generation server gets the context server's result as "generation_only".
    disaggregated_params: DisaggregatedParams | None = None
    response_format: dict | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[StrictInt, float] | None = None  # JSON keys are strings of token ids

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value):
        if not isinstance(value, dict):
            return value
        try:
            return {int(k): v for k, v in value.items()}
        except (TypeError, ValueError):
            raise ValueError('keys must be token ids (e.g. {"1234": -100})') from None

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value):
        if value is not None and any(not -100 <= v <= 100 for v in value.values()):
            raise ValueError("biases must be in [-100, 100]")
        return value

    best_of: object = None
    suffix: object = None
    echo: object = None
    tools: object = None
    functions: object = None
    tool_choice: object = None
    function_call: object = None

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, value, info):
        if not any(
            value == default and type(value) is type(default)
            for default in _UNSUPPORTED[info.field_name]
        ):
            raise ValueError(f"{info.field_name} is not supported by this server (yet)")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value is not None and value.get("type", "text") != "text":
            raise ValueError(
                "only {'type': 'text'} is supported (no json_object or json_schema output)"
            )
        return value

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class CompletionRequest(_SamplingFields):
    # one prompt (text or token ids) or a list of them: a choice per prompt (times n)
    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # top tokens per token

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
        return [prompt] if single else list(prompt)

    @field_validator("prompt")
    @classmethod
    def _choices_in_range(cls, prompt, info):
        if not prompt:
            raise ValueError("is empty")
        single = isinstance(prompt, str) or isinstance(prompt[0], int)
        num_prompts, n = 1 if single else len(prompt), info.data.get("n", 1)
        if num_prompts * n > MAX_CHOICES:
            raise ValueError(f"{num_prompts} prompts times n={n} is over {MAX_CHOICES} choices")
        return prompt


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
            return value
        try:
            decoded = json.loads(value or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not JSON ({exc.msg} at {exc.pos})") from None
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
        for j, call in enumerate(self.tool_calls or ()):
            arguments = json.dumps(call.function.arguments, ensure_ascii=False)
            out.append((f"{where}.tool_calls.{j}.function.name", call.function.name))
            out.append((f"{where}.tool_calls.{j}.function.arguments", arguments))
        return out


class Thinking(BaseModel):
    """``thinking: {"type": ...}`` (other keys, such as a token budget, are ignored)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive", "auto"]


# reasoning_effort -> thinking_mode: none and minimal think not at all, low leaves it to the model
EFFORT_MODES = {
    "none": "disabled",
    "minimal": "disabled",
    "low": "adaptive",
    "medium": "enabled",
    "high": "enabled",
}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    # the chat template's variables (``thinking_mode``: enabled, disabled or adaptive)
    chat_template_kwargs: dict | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        self.template_kwargs()  # (a conflict between the ways to ask for thinking: a 400)
        return self

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict:
        """``chat_template_kwargs`` with ``thinking_mode`` set from whichever way the request
        asks for it (``chat_template_kwargs.thinking_mode`` or ``.enable_thinking``,
        ``thinking.type``, ``reasoning_effort``; ``adaptive`` when none does); ways that
        disagree are an error naming them."""
        kwargs = dict(self.chat_template_kwargs or {})
        asked: dict[str, str] = {}
        if "thinking_mode" in kwargs:
            mode = kwargs["thinking_mode"]
            if mode not in THINKING_MODES:
                raise ValueError(
                    f"chat_template_kwargs.thinking_mode={mode!r}: expected one of "
                    f"{list(THINKING_MODES)}"
                )
            asked["chat_template_kwargs.thinking_mode"] = mode
        if "enable_thinking" in kwargs:
            if not isinstance(kwargs["enable_thinking"], bool):
                raise ValueError("chat_template_kwargs.enable_thinking must be true or false")
            mode = "enabled" if kwargs["enable_thinking"] else "disabled"
            asked["chat_template_kwargs.enable_thinking"] = mode
        if self.thinking is not None:
            mode = "adaptive" if self.thinking.type == "auto" else self.thinking.type
            asked["thinking.type"] = mode
        if self.reasoning_effort is not None:
            asked["reasoning_effort"] = EFFORT_MODES[self.reasoning_effort]
        if len(set(asked.values())) > 1:
            said = ", ".join(f"{k} asks {v}" for k, v in asked.items())
            raise ValueError(f"the ways to ask for thinking disagree: {said}")
        kwargs["thinking_mode"] = next(iter(asked.values()), "adaptive")
        return kwargs


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
