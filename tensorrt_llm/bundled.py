"""The bundled MiniMax-M3-tiny target and Eagle3 drafter (``examples/models/m3-tiny``)."""

from __future__ import annotations

import functools
from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "examples" / "models" / "m3-tiny"
BUNDLED_TARGET = BUNDLED_DIR / "target"
BUNDLED_DRAFT = BUNDLED_DIR / "eagle3"


def bundled_target() -> str:
    if not (BUNDLED_TARGET / "config.json").is_file():
        raise ValueError(
            f"model was not given and the bundled checkpoint is missing at {BUNDLED_TARGET}"
        )
    return str(BUNDLED_TARGET)


def bundled_eagle3(draft_kv_cache: str = "unified") -> dict:
    """The ``speculative_config`` of the bundled drafter (what ``trtllm-serve`` runs by default):
    Eagle3 one-model, three draft tokens."""
    return {
        "decoding_type": "Eagle3",
        "max_draft_len": 3,
        "speculative_model": str(BUNDLED_DRAFT),
        "draft_kv_cache": draft_kv_cache,
    }


@functools.cache
def _bundled_tokenizer():
    from tensorrt_llm.tokenizer import TransformersTokenizer

    return TransformersTokenizer.from_pretrained(bundled_target())


def bundled_prompt(content: str, **template_kwargs) -> str:
    """A one-turn prompt as the bundled checkpoint's chat template renders it (MiniMax-M3's
    protocol; ``template_kwargs`` such as ``thinking_mode``), for ``/v1/completions`` and
    ``LLM.generate``."""
    messages = [{"role": "user", "content": content}]
    return _bundled_tokenizer().apply_chat_template(messages, **template_kwargs)
