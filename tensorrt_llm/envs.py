"""Every ``TRTLLM_*`` environment variable the package reads, declared once.

Read a variable with ``envs.NAME.get()``; the value is parsed on every call, so tests can set the
environment with ``monkeypatch.setenv`` and see the change. A malformed value raises ``ValueError``
naming the variable and the value.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r} is not valid: {exc}") from None

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""


def _optional_int(raw: str) -> int | None:
    return int(raw)


TRTLLM_LOG_LEVEL: EnvVar[str] = EnvVar(
    "TRTLLM_LOG_LEVEL",
    "info",
    str,
    "Log level of the tensorrt_llm logger: trace, debug, info, warning or error.",
)

TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK: EnvVar[int | None] = EnvVar(
    "TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK",
    None,
    _optional_int,
    "Tokens per kernel page of the MiniMax-M3 Eagle3 draft sub-page view (default 32). Must be a "
    "power of two dividing tokens_per_block; equal to tokens_per_block gives the identity view.",
)

TRTLLM_DISAGG_SECRET: EnvVar[str] = EnvVar(
    "TRTLLM_DISAGG_SECRET",
    "",
    str,
    "The secret a disaggregated deployment shares (at least 16 characters, the same on the router "
    "and on every context and generation server): context servers sign their KV transfer handles "
    "with it, generation servers accept only handles it verifies, and the servers take "
    "disaggregated_params only from a caller that presents it (the router).",
)

TRTLLM_API_KEY: EnvVar[str] = EnvVar(
    "TRTLLM_API_KEY",
    "",
    str,
    "trtllm-serve's API key when --api-key is not given: every path but /health then needs "
    "'Authorization: Bearer <key>' (the router forwards the client's header to its servers).",
)

ALL: tuple[EnvVar, ...] = (
    TRTLLM_LOG_LEVEL,
    TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK,
    TRTLLM_DISAGG_SECRET,
    TRTLLM_API_KEY,
)
