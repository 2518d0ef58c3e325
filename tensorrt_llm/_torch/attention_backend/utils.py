"""``get_attention_backend``: an attention backend by its ``attn_backend`` name (upstream's names)."""

from __future__ import annotations

from collections.abc import Callable

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend


def _triton_backend() -> AttentionBackend:
    """Imported on demand, so that selecting another backend never imports Triton."""
    try:
        import triton.language  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            "attn_backend='TRITON' needs the triton package, which is not importable here "
            f"({exc}); install it (pip install 'triton>=3.0') or use attn_backend='VANILLA'"
        ) from exc
    from tensorrt_llm._torch.attention_backend.triton.backend import TritonAttentionBackend

    return TritonAttentionBackend()


# name -> factory; a new backend is one line here.
ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "VANILLA": VanillaAttentionBackend,
    "TRITON": _triton_backend,
}


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend instance for ``name`` (exact, upper case as upstream: ``"VANILLA"``,
    ``"TRITON"``). Raises ``ValueError`` for an unknown name or a backend that cannot run here."""
    factory = ATTENTION_BACKENDS.get(name)
    if factory is not None:
        return factory()
    raise ValueError(f"attn_backend={name!r} is unknown; available: {sorted(ATTENTION_BACKENDS)}")
