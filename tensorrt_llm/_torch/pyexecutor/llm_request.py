"""A request as the executor, the scheduler and the resource managers see it."""

from __future__ import annotations

import enum
import math
import random
import struct
from dataclasses import dataclass, field

import torch

from tensorrt_llm._torch.pyexecutor.multimodal import MultimodalInput
from tensorrt_llm.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request ended. A ``str`` enum: JSON and the OpenAI replies carry the plain value."""

    STOP = "stop"  # the end id, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or max_seq_len reached
    CANCELLED = "cancelled"  # the client went away, or a cancel call
    ERROR = "error"  # a failed step or a request that could not start (``stop_reason``: why)
    CONTEXT_DONE = "context_done"  # a context-only request finished its prompt; its KV is held


class ErrorKind(enum.StrEnum):
    """Whose fault a request's error is; the server maps each to an HTTP status once."""

    INVALID_REQUEST = "invalid_request"  # the request cannot run here (refused at admission)
    ENGINE_FAULT = "engine_fault"  # a step failed: this request caused it, or was in it
    KV_TRANSFER = "kv_transfer"  # its prompt's KV could not be pulled from the context server
    RANK_LOST = "rank_lost"  # a rank of this server is gone: nothing can run until a restart


class RequestError(str):
    """Why a request ended with ``FinishReason.ERROR`` (its ``stop_reason``): the message, a
    ``str`` as a stop reason always was (JSON and string operations take it as one), that also
    says whose fault it was (``kind``)."""

    kind: ErrorKind

    def __new__(cls, kind: ErrorKind, message: str) -> RequestError:
        error = super().__new__(cls, message)
        error.kind = ErrorKind(kind)
        return error

    @property
    def message(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"RequestError({self.kind.value!r}, {self.message!r})"


def stop_reason_to_json(stop_reason: int | str | RequestError | None):
    """A ``stop_reason`` as JSON (ranks report their requests' ends to rank 0)."""
    if isinstance(stop_reason, RequestError):
        return {"kind": stop_reason.kind.value, "message": stop_reason.message}
    return stop_reason


def stop_reason_from_json(value) -> int | str | RequestError | None:
    if isinstance(value, dict):
        return RequestError(ErrorKind(value["kind"]), str(value["message"]))
    return value


@dataclass(frozen=True)
class SamplingRow:
    """A request's row of a batch's sampling tensors (``sampler.SamplingTensors``), fixed when the
    request is made and checked there to fit them (float32, int64): a request the device cannot
    represent is refused before it joins a batch, never while a batch is launched."""

    temperature: float  # 0: greedy
    top_p: float  # 1: every token
    top_k: int  # 0: every token
    seed: int

    @classmethod
    def of(cls, params: SamplingParams, seed: int) -> SamplingRow:
        row = cls(
            0.0 if params.greedy else float(params.temperature),
            1.0 if params.top_p is None else float(params.top_p),
            int(params.top_k or 0),
            seed,
        )
        if not (_finite_float32(row.temperature) and _finite_float32(row.top_p)):
            raise ValueError(
                f"temperature={params.temperature!r}, top_p={params.top_p!r}: not finite in float32"
            )
        for name in ("top_k", "seed"):
            if not INT64_MIN <= getattr(row, name) <= INT64_MAX:
                raise ValueError(f"{name}={getattr(row, name)!r}: out of int64")
        return row


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _finite_float32(value: float) -> bool:
    """Whether ``value`` stays finite as a float32 (rounded as the device's tensors round it)."""
    try:
        return math.isfinite(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:  # (past float32's range: a tensor would hold inf)
        return False


class LlmRequestState(enum.Enum):
    # its guided decoding's grammar compiling (``guided_decoder.py``): the scheduler passes it over
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    CONTEXT_INIT = "context_init"  # prompt (or part of it) still to prefill
    # a generation-only request admitted, its prompt's KV being pulled from a context server
    DISAGG_GENERATION_TRANS_IN_PROGRESS = "disagg_generation_trans_in_progress"
    GENERATION_IN_PROGRESS = "generation_in_progress"
    GENERATION_COMPLETE = "generation_complete"


@dataclass(eq=False)
class LlmRequest:
    """Token state of one request.

    ``context_current_position`` counts prompt tokens whose KV is written (reused ones included);
    ``context_chunk_size`` is how many more the current step prefills. ``py_draft_tokens`` are the
    drafts a generation step verifies.
    """

    request_id: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    end_ids: tuple[int, ...] = ()  # any of them ends the request (unless ignore_eos)
    # the token sequences its output never ends with (``SamplingParams.bad_word_ids``: its bad
    # words and bad token ids, tokenized by the LLM)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    context_current_position: int = 0
    context_chunk_size: int = 0
    py_draft_tokens: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    num_reused_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | RequestError | None = None  # an ERROR's: a RequestError
    num_decode_iterations: int = 0  # generation steps (each verifies the previous drafts)
    num_accepted_draft_tokens: int = 0
    # the seed of the request's random numbers (``sampler.uniform``): SamplingParams.seed, else
    # drawn here; and its sampling steps so far (each step's numbers are new)
    seed: int = field(init=False)
    num_sampling_steps: int = 0
    py_generation_logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] per token
    # per emitted token, when asked (SamplingParams.logprobs): its log-probability, and the
    # (token, log-probability) of the most likely tokens at its position
    py_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # Disaggregated serving: a context-only request stops after its prompt (first token and first
    # drafts made) and keeps its KV for a generation server to pull.
    context_only: bool = False
    received_at: float | None = None  # time.monotonic() when the engine core received it
    admitted_at: float | None = None  # time.monotonic() when the scheduler granted its KV
    multimodal: MultimodalInput | None = None  # its images (``multimodal.py``)
    # the prompt as the KV cache keys its blocks: each image's placeholders replaced by its key id
    prompt_key_ids: list[int] = field(init=False)
    sampling_row: SamplingRow = field(init=False)

    def __post_init__(self) -> None:
        seed = self.sampling_params.seed
        self.seed = seed if seed is not None else random.getrandbits(63)
        self.sampling_row = SamplingRow.of(self.sampling_params, self.seed)
        params = self.sampling_params
        if (params.bad or params.bad_token_ids) and not self.bad_word_ids:
            raise ValueError(
                "SamplingParams.bad and bad_token_ids reach the engine as LlmRequest.bad_word_ids "
                "(SamplingParams.bad_word_ids)"
            )
        self.bad_word_ids = tuple(tuple(word) for word in self.bad_word_ids)
        mm = self.multimodal
        self.prompt_key_ids = (
            self.prompt_token_ids if mm is None else mm.key_tokens(self.prompt_token_ids)
        )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_context_init_state(self) -> bool:
        return self.state is LlmRequestState.CONTEXT_INIT

    @property
    def is_finished(self) -> bool:
        return self.state is LlmRequestState.GENERATION_COMPLETE

    @property
    def context_chunk(self) -> list[int]:
        """The prompt tokens its next prefill step computes (the chunk: none of them cached)."""
        start = self.context_current_position
        return self.prompt_token_ids[start : start + self.context_chunk_size]

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= self.prompt_len

    def skip_reused_prefix(self, num_tokens: int) -> None:
        """Start prefill after ``num_tokens`` prompt tokens whose KV came from the prefix cache."""
        self.num_reused_tokens = num_tokens
        if self.context_current_position < num_tokens:
            self.context_chunk_size = min(self.context_chunk_size, self.prompt_len - num_tokens)
            self.context_current_position = num_tokens

    def get_tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_key_tokens(self) -> list[int]:
        """``get_tokens`` as block keys see them (``prompt_key_ids``)."""
        return self.prompt_key_ids + self.output_token_ids

    @property
    def last_token(self) -> int:
        """``get_tokens()[-1]``, without copying a long context's tokens every step."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def key_tokens(self, start: int, end: int) -> list[int]:
        """``get_key_tokens()[start:end]``, copying only those tokens."""
        num_prompt = len(self.prompt_key_ids)
        head = self.prompt_key_ids[start:end] if start < num_prompt else []
        return head + self.output_token_ids[max(start - num_prompt, 0) : max(end - num_prompt, 0)]

    def get_num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def avg_decoded_tokens_per_iter(self) -> float | None:
        """Acceptance length: tokens each generation step produced, on average (accepted drafts + 1)."""
        if not self.num_decode_iterations:
            return None
        return (
            self.num_accepted_draft_tokens + self.num_decode_iterations
        ) / self.num_decode_iterations

    def finish(
        self, reason: FinishReason, stop_reason: int | str | RequestError | None = None
    ) -> None:
        self.state = LlmRequestState.GENERATION_COMPLETE
        self.finish_reason = FinishReason(reason)
        self.stop_reason = stop_reason

    def fail(self, kind: ErrorKind, message: str) -> None:
        """End with ``FinishReason.ERROR``, saying whose fault it is and why."""
        self.finish(FinishReason.ERROR, RequestError(kind, message))
