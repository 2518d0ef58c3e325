"""The typed messages of disaggregated serving: what the router and the servers exchange.

They cross HTTP as JSON (``model_dump(mode="json")`` on one side, ``model_validate`` on the other);
nothing is unpickled. One request's round trip:

    router -> context server      {"request_type": "context_only"}
    context server -> router      {"request_type": "context_only", "first_token", "draft_tokens",
                                   "prompt_token_ids", "transfer_handle", "images" (if any)}
                               or {"request_type": "finished", "output_token_ids", "finish_reason"}
    router -> generation server   the handle reply, with "request_type": "generation_only"

Every model forbids unknown keys, so a malformed message is an error naming the key.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import json
import re

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason


class RequestType(enum.StrEnum):
    CONTEXT_ONLY = "context_only"  # prefill, keep the KV, answer with a transfer handle
    GENERATION_ONLY = "generation_only"  # pull the handle's KV, then decode
    FINISHED = "finished"  # the context server's reply when the request ended there (EOS at once)


# ``Mapping.describe()``: the attention layout and its ranks, then the MoE layout (experts per
# expert group and intermediate slices), which the KV layout does not depend on
PARALLEL_PATTERN = r"^(tp|adp)([1-9][0-9]*)(-ep[1-9][0-9]*-moetp[1-9][0-9]*)?$"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolFingerprint(_Message):
    slot_bytes: int
    # One entry per buffer in the slot, in slot order: (layer_id, role, offset, size in bytes, dtype).
    buffers: list[tuple[int, str, int, int, str]]


# a KV cache dtype as the user named it (``KvCacheConfig.dtype`` resolved: "bfloat16", "fp8", ...)
KV_DTYPE_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"


class LayoutFingerprint(_Message):
    """Everything two peers must agree on to exchange slots byte for byte, and its digest."""

    # the KV cache dtype the server was started with; ``pools`` holds each buffer's own dtype
    # (an FP8 cache's scale buffers are float32), so two servers of one ``kv_dtype`` agree there too
    kv_dtype: str = Field(pattern=KV_DTYPE_PATTERN)
    tokens_per_block: int
    layers: list[int]
    draft_layers: list[int]
    pools: list[PoolFingerprint]
    # the parallel layout of the server (``Mapping.describe()``: "tp1", "tp2", "adp2"): which
    # heads a slot holds depends on it (``head_regroup.py`` maps heads between layouts)
    parallel: str = Field(pattern=PARALLEL_PATTERN)
    digest: str  # sha256 of the other fields (sorted-key JSON)

    @classmethod
    def build(
        cls,
        kv_dtype: str,
        tokens_per_block: int,
        layers: list[int],
        draft_layers: list[int],
        pools: list[PoolFingerprint],
        parallel: str = "tp1",
    ) -> LayoutFingerprint:
        body = {
            "kv_dtype": kv_dtype,
            "parallel": parallel,
            "tokens_per_block": tokens_per_block,
            "layers": list(layers),
            "draft_layers": list(draft_layers),
            "pools": [pool.model_dump(mode="json") for pool in pools],
        }
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        return cls(**body, digest=digest)

    def differences(self, theirs: LayoutFingerprint) -> list[str]:
        """``"key: local ... vs peer ..."`` for every field (digest aside) where the two differ."""
        mine, other = self.model_dump(exclude={"digest"}), theirs.model_dump(exclude={"digest"})
        return [f"{k}: local {mine[k]!r} vs peer {other[k]!r}" for k in mine if mine[k] != other[k]]


TRANSFER_ID_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"


def parallel_ranks(parallel: str) -> tuple[bool, int]:
    """``(attention DP, ranks)`` of a layout's ``Mapping.describe()``: ``"tp2"`` -> (False, 2)."""
    match = re.fullmatch(PARALLEL_PATTERN, parallel)
    if match is None:
        raise ValueError(f"parallel={parallel!r} is not a parallel layout (tp<N> or adp<N>)")
    return match.group(1) == "adp", int(match.group(2))


def _check_base64(value: str) -> str:
    try:
        base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError(f"agent_metadata={value[:16]!r}... is not base64") from None
    return value


class SourceRank(_Message):
    """One context rank's part of a transfer: where its slots and this hold's ticket are. Under
    tensor parallelism every context rank holds the same slot ids (deterministic allocation)
    with its own heads in them, so a handle lists each rank's agent, pools and ticket."""

    agent_name: str  # the rank's NIXL agent
    agent_metadata: str  # base64 of the agent's NIXL metadata bytes
    pool_addresses: list[NonNegativeInt]  # base address of each pool, in pool order
    device_id: NonNegativeInt = 0  # the pools' CUDA device on the rank (its cuda:<rank>)
    ticket_address: NonNegativeInt  # where the rank keeps this hold's ticket (8 bytes)
    ticket: int = Field(gt=0, lt=2**63)

    _is_base64 = field_validator("agent_metadata")(_check_base64)

    def agent_metadata_bytes(self) -> bytes:
        return base64.b64decode(self.agent_metadata)


class TransferHandle(_Message):
    """What a generation server needs to pull one request's slots from a context server.

    ``transfer_id`` is an unguessable id the context server gives this hold (and nothing else):
    the pull's notification names it, and only a notification naming a live hold's id releases
    that hold. ``ticket`` is a random nonce the context server keeps at ``ticket_address`` while
    the hold lives and zeroes before it frees the slots: the puller reads it back after the data,
    so data read from slots that were freed meanwhile is never used. ``expires_at`` (wall clock,
    seconds) is when the context server frees the slots unpulled; a handle that near its end is
    refused before any read.
    """

    request_id: int  # the context server's id of the request (for logs)
    transfer_id: str = Field(pattern=TRANSFER_ID_PATTERN)
    expires_at: float
    agent_name: str  # the context server's NIXL agent
    agent_metadata: str  # base64 of the agent's NIXL metadata bytes
    fingerprint: LayoutFingerprint
    slots: list[NonNegativeInt]  # the context server's slot id per logical block of the prompt
    pool_addresses: list[NonNegativeInt]  # base address of each pool, in pool order
    device_id: NonNegativeInt = 0  # the pools' CUDA device on the context server's rank 0
    ticket_address: NonNegativeInt  # where the context server keeps this hold's ticket (8 bytes)
    ticket: int = Field(gt=0, lt=2**63)
    # a context server of several tensor-parallel ranks: ranks 1.. (the fields above are rank 0's)
    other_ranks: list[SourceRank] = Field(default_factory=list)

    _is_base64 = field_validator("agent_metadata")(_check_base64)

    @model_validator(mode="after")
    def _one_source_per_rank(self) -> TransferHandle:
        attention_dp, ranks = parallel_ranks(self.fingerprint.parallel)
        if attention_dp:
            raise ValueError(
                f"fingerprint.parallel={self.fingerprint.parallel!r}: context servers run "
                "tensor parallel (tp<N>), not attention DP"
            )
        if len(self.other_ranks) != ranks - 1:
            raise ValueError(
                f"a {self.fingerprint.parallel} context server's handle lists {ranks - 1} other "
                f"ranks, got {len(self.other_ranks)}"
            )
        return self

    def agent_metadata_bytes(self) -> bytes:
        return base64.b64decode(self.agent_metadata)

    def sources(self) -> list[SourceRank]:
        """Every context rank's part, in rank order."""
        first = SourceRank(
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            pool_addresses=self.pool_addresses,
            device_id=self.device_id,
            ticket_address=self.ticket_address,
            ticket=self.ticket,
        )
        return [first, *self.other_ranks]


class ImageRef(_Message):
    """An image of a prompt by where its tokens are and its digest: the generation server keys
    the prompt's blocks by it (``multimodal.py``) and never needs the image itself."""

    offset: NonNegativeInt  # its first placeholder's prompt position
    num_tokens: int = Field(gt=0)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")


_HANDLE_FIELDS = ("first_token", "prompt_token_ids", "transfer_handle")
_FINISHED_FIELDS = ("output_token_ids", "finish_reason")


class DisaggregatedParams(_Message):
    """The ``disaggregated_params`` of a request or a reply (upstream TensorRT-LLM's name).

    A ``context_only`` request carries no other field; a ``context_only`` reply and a
    ``generation_only`` request carry the handle fields (``first_token``, ``draft_tokens``,
    ``prompt_token_ids``, ``transfer_handle``); a ``finished`` reply carries ``output_token_ids``
    and ``finish_reason``.
    """

    request_type: RequestType
    first_token: int | None = None  # the token the context server's prefill produced
    draft_tokens: list[int] = Field(default_factory=list)  # the drafts made with it
    prompt_token_ids: list[int] | None = None
    transfer_handle: TransferHandle | None = None
    images: list[ImageRef] | None = None  # the prompt's images, in order (a handle field)
    output_token_ids: list[int] | None = None
    finish_reason: FinishReason | None = None
    # HMAC-SHA256 (hex) of the other fields but request_type, by the context server (trust.py)
    signature: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _fields_match_the_request_type(self) -> DisaggregatedParams:
        kind, handle_given = self.request_type.value, _given(self, _HANDLE_FIELDS)
        if self.request_type is RequestType.FINISHED:
            handle_given += ["images"] if self.images is not None else []
            if handle_given:
                raise ValueError(f"request_type={kind!r} takes no {handle_given}")
            if self.finish_reason is None:
                raise ValueError(f"request_type={kind!r} needs finish_reason")
            return self
        if _given(self, _FINISHED_FIELDS):
            raise ValueError(f"request_type={kind!r} takes no {_given(self, _FINISHED_FIELDS)}")
        missing = _missing(self, _HANDLE_FIELDS)
        if missing and (handle_given or self.request_type is RequestType.GENERATION_ONLY):
            raise ValueError(
                f"request_type={kind!r} needs the context server's {list(_HANDLE_FIELDS)}; "
                f"missing {missing}"
            )
        return self

    def to_json(self) -> dict:
        """The wire form: plain JSON types, unset fields left out (``model_validate`` reads it)."""
        return self.model_dump(mode="json", exclude_defaults=True)

    @property
    def has_handle(self) -> bool:
        return self.transfer_handle is not None

    def for_generation(self) -> DisaggregatedParams:
        """The ``generation_only`` request made from a context server's ``context_only`` reply."""
        if not self.has_handle:
            raise ValueError(
                f"request_type={self.request_type.value!r} carries no transfer_handle to generate from"
            )
        return self.model_copy(update={"request_type": RequestType.GENERATION_ONLY})


def _given(params: DisaggregatedParams, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if getattr(params, name) is not None]


def _missing(params: DisaggregatedParams, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if getattr(params, name) is None]
