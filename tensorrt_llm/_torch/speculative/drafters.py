"""The one-model drafter of a speculative config, as the creation site needs it: the drafter
itself, the KV layer it appends to the target's, and the target layers its features come from.

- Eagle3 (``Eagle3SpecConfig``): its own checkpoint (``load_eagle3``); a layer of its own geometry
  (a sub-page of the target's slots in unified mode); three captured target layers, fused.
- MTP (``MTPSpecConfig``): the target's own module (``MTPDrafter``; built and loaded with the
  target, ``workers.mtp_options``); a sparse layer of the target's geometry (whole pages); the
  target's input embeddings and its hidden states after the final norm.
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.models.checkpoint import load_eagle3
from tensorrt_llm._torch.models.modeling_speculative import default_layers_to_capture
from tensorrt_llm._torch.pyexecutor.config import KvCacheLayer, PyExecutorConfig
from tensorrt_llm._torch.speculative.interface import MTPSpecConfig
from tensorrt_llm._torch.speculative.mtp import MTPDrafter


def load_drafter(model: torch.nn.Module, executor_config: PyExecutorConfig):
    """The drafter of ``executor_config.speculative`` (None without one)."""
    spec = executor_config.speculative
    if spec is None:
        return None
    if isinstance(spec, MTPSpecConfig):
        return MTPDrafter(model)
    return load_eagle3(
        spec.speculative_model,
        model,
        model.config.num_hidden_layers,
        next(model.parameters()).dtype,
        torch.device(executor_config.device),
        executor_config.attn_backend,
        executor_config.mapping,
        executor_config.load_format,
    )


def draft_kv_layer(drafter, mapping) -> KvCacheLayer:
    """What the drafter's layer caches per token on this rank."""
    if isinstance(drafter, MTPDrafter):
        return drafter.kv_cache_layer(mapping)
    attention = drafter.midlayer.self_attn  # this rank's heads
    return KvCacheLayer(attention.num_kv_heads, attention.head_dim)


def layers_to_capture(spec, drafter, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs feed the drafter (an MTP module's: -1, the input
    embeddings, and ``num_target_layers``, after the final norm)."""
    if isinstance(drafter, MTPDrafter):
        return (-1, num_target_layers)
    layers = spec.eagle3_layers_to_capture or drafter.config.eagle3_layers_to_capture
    layers = tuple(layers or default_layers_to_capture(num_target_layers))
    if len(layers) != 3 or not all(0 <= i < num_target_layers for i in layers):
        raise ValueError(
            f"eagle3_layers_to_capture={layers}: need three target layer ids in "
            f"[0, {num_target_layers})"
        )
    return layers
