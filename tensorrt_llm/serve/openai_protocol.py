"""OpenAI-compatible request and response bodies (the subset this server implements)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import (
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
from tensorrt_llm.sampling_params import GuidedDecodingParams
from tensorrt_llm.serve.chat_messages import (  # (re-exported: the protocol's names)
    ChatCompletionToolsParam,
    ChatMessage,
    FunctionDefinition,
    ImageUrlPart,
    NamedToolChoice,
    Text,
    TextPart,
    ToolCall,
    ToolCallFunction,
)
from tensorrt_llm.serve.structured_output import response_guide, structured_guide

__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionToolsParam",
    "ChatMessage",
    "CompletionRequest",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionDefinition",
    "ImageUrlPart",
    "NamedToolChoice",
    "TextPart",
    "ToolCall",
    "ToolCallFunction",
    "new_id",
    "now",
]

MAX_CHOICES = 16  # choices of one request: prompts times n


# Fields clients send that would change the result if ignored: refused (a 400 naming the field)
# unless they ask for the default. Any other unknown field is ignored with a logged warning.
_UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "echo": (None, False),
    "functions": (None, []),
    "function_call": (None, "none"),
}
_COMPLETIONS_UNSUPPORTED = {"tools": (None, []), "tool_choice": (None, "none")}  # (chat's only)
MAX_TOOLS = 128  # tools of one request (OpenAI's limit)
MAX_TOOLS_BYTES = 256 * 1024  # their JSON, all together


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
    structured_outputs: dict | None = None  # (vLLM's)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[StrictInt, float] | None = None  # JSON keys are strings of token ids
    # vLLM's token constraints (SamplingParams' stop_token_ids, allowed_token_ids and bad)
    stop_token_ids: list[StrictInt] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[Text] | None = None

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
    functions: object = None
    function_call: object = None

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, value, info):
        return _only_default(value, info.field_name, _UNSUPPORTED)

    @field_validator("response_format")
    @classmethod
    def _a_known_format(cls, value):
        response_guide(value)  # (its FormatError is a ValueError: a 400 naming the field)
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _a_known_structure(cls, value, info):
        structured_guide(value, response_guide(info.data.get("response_format")))  # (as above)
        return value

    def response_guide(self) -> GuidedDecodingParams | None:
        """What ``response_format`` and ``structured_outputs`` hold the output to (None:
        text)."""
        return structured_guide(self.structured_outputs, response_guide(self.response_format))

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def _only_default(value, name: str, defaults: dict):
    if not any(value == default and type(value) is type(default) for default in defaults[name]):
        raise ValueError(f"{name} is not supported by this server (yet)")
    return value


class CompletionRequest(_SamplingFields):
    # one prompt (text or token ids) or a list of them: a choice per prompt (times n)
    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # top tokens per token
    tools: object = None
    tool_choice: object = None

    @field_validator(*_COMPLETIONS_UNSUPPORTED)
    @classmethod
    def _no_tools(cls, value, info):
        return _only_default(value, info.field_name, _COMPLETIONS_UNSUPPORTED)

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
    tools: list[ChatCompletionToolsParam] | None = Field(default=None, max_length=MAX_TOOLS)
    # auto (the default with tools), none, required (some call), or a named function
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @field_validator("tools")
    @classmethod
    def _tools_within_limits(cls, tools):
        if not tools:
            return tools
        names = [tool.function.name for tool in tools]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"tool names must differ; {twice} repeat")
        size = len(json.dumps([tool.model_dump() for tool in tools]))
        if size > MAX_TOOLS_BYTES:
            raise ValueError(f"the tools are {size} bytes of JSON; at most {MAX_TOOLS_BYTES}")
        return tools

    def calls_tools(self) -> bool:
        """Whether the reply is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("tool_choice")
    @classmethod
    def _a_choice_of_the_tools(cls, choice, info):
        if choice in (None, "none", "auto"):
            return choice
        tools = info.data.get("tools")
        if not tools:
            raise ValueError(f"{choice!r} needs tools")
        names = [tool.function.name for tool in tools]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names {choice.function.name!r}, not one of the tools")
        return choice

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
        if self.tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
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
