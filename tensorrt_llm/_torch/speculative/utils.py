"""Helpers shared by the speculative-decoding workers and the resource managers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig


def get_num_spec_layers(spec_config: Eagle3DecodingConfig | None) -> int:
    """Draft layers a one-model speculative config appends to the target's KV cache (0 otherwise)."""
    if spec_config is None or not spec_config.eagle3_one_model:
        return 0
    return spec_config.num_eagle_layers


def get_num_extra_kv_tokens(spec_config: Eagle3DecodingConfig | None) -> int:
    """Positions a sequence may hold beyond its length while drafts are verified."""
    return 0 if spec_config is None else spec_config.max_draft_len
