"""OpenAI-compatible request and response bodies (the subset this server implements)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _SamplingFields(OpenAIBaseModel):
    model: str | None = None
    # Strict: `true` is not a max_tokens and "yes" is not a stream flag.
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = Field(default=1, ge=1, le=1)
    user: str | None = None
    ignore_eos: StrictBool = False
    # Disaggregated serving: {"request_type": "context_only"} asks a context server to prefill and
    # keep the KV; a generation server gets the context server's result as "generation_only".
    disaggregated_params: DisaggregatedParams | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # top tokens per token

    def wanted_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
