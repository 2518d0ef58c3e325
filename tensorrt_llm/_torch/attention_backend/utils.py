"""``get_attention_backend``: an attention backend by its ``attn_backend`` name (upstream's names)."""

from __future__ import annotations

from collections.abc import Callable

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend

# name -> factory; a new backend is one line here.
ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "VANILLA": VanillaAttentionBackend,
}
# Upstream names this fork does not implement yet.
PLANNED_ATTENTION_BACKENDS = ("TRITON",)


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend instance for ``name`` (exact, upper case as upstream: ``"VANILLA"``)."""
    factory = ATTENTION_BACKENDS.get(name)
    if factory is not None:
        return factory()
    available = sorted(ATTENTION_BACKENDS)
    if name in PLANNED_ATTENTION_BACKENDS:
        raise ValueError(f"attn_backend={name!r} is not available yet; available: {available}")
    known = sorted([*available, *PLANNED_ATTENTION_BACKENDS])
    raise ValueError(f"attn_backend={name!r} is unknown; known: {known}, available: {available}")
