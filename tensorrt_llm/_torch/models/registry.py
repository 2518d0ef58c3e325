"""Models by architecture: ``config.json``'s ``architectures[0]`` selects the config class, the model
class and the KV cache manager class.

A second architecture is one new modeling file and one line in ``MODEL_REGISTRY``. Its classes
follow the M3 ones:

- config class: a frozen dataclass with ``from_dict(data)`` / ``from_pretrained(model_dir)`` /
  ``to_dict()`` for ``config.json``,
  the fields ``ModelConfig`` lists, and ``kv_cache_layers(mapping)`` (what each layer caches per
  token on one rank);
- model class: ``model_class(config, attn_backend, mapping)``, an ``nn.Module`` (this rank's
  shard) with ``config``, ``attn_backend``, ``model.embed_tokens``, ``forward(input_ids, position_ids=None,
  attn_metadata=None, capture_layers=())`` -> ``(hidden, captured)`` and ``compute_logits(hidden, out=None)``;
- KV cache manager class: a ``KVCacheManagerV2`` (the creation site builds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.configuration_minimaxm3 import (
    TEXT_ARCHITECTURE,
    VL_ARCHITECTURE,
    MiniMaxM3Config,
)
from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3ForCausalLM
from tensorrt_llm._torch.pyexecutor.config import KvCacheLayer
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2


class ModelConfig(Protocol):
    """What the loaders read of a registered config class."""

    @property
    def architectures(self) -> tuple[str, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...

    @property
    def torch_dtype(self) -> str: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def quant_algo(self) -> str | None: ...  # the checkpoint's ("FP8_BLOCK_SCALES") or None

    @property
    def modules_to_not_convert(self) -> tuple[str, ...]: ...

    def kv_cache_layers(self, mapping: Mapping | None = None) -> tuple[KvCacheLayer, ...]: ...

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig: ...

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ModelClasses:
    """The classes one architecture is built from."""

    config_class: type[ModelConfig]
    model_class: type[nn.Module]  # model_class(config, attn_backend, mapping)
    kv_cache_manager_class: type[KVCacheManagerV2]


_MINIMAX_M3 = ModelClasses(MiniMaxM3Config, MiniMaxM3ForCausalLM, MiniMaxM3KVCacheManagerV2)
MODEL_REGISTRY: dict[str, ModelClasses] = {
    VL_ARCHITECTURE: _MINIMAX_M3,  # the hub's VL checkpoints (text served)
    TEXT_ARCHITECTURE: _MINIMAX_M3,  # transformers' text-only save
}


def get_model_classes(architecture: str) -> ModelClasses:
    """The registered classes of ``architecture`` (``config.json``'s ``architectures[0]``)."""
    classes = MODEL_REGISTRY.get(architecture)
    if classes is None:
        raise ValueError(
            f"architectures[0]={architecture!r} is not a known architecture; "
            f"known: {sorted(MODEL_REGISTRY)}"
        )
    return classes


def architecture_of(data: dict[str, Any], where: str) -> str:
    """``architectures[0]`` of a parsed ``config.json`` (``where`` names the file in errors)."""
    architectures = data.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise ValueError(
            f"{where}: architectures={architectures!r}, expected a non-empty list such as "
            f"{sorted(MODEL_REGISTRY)[:1]}"
        )
    return architectures[0]
