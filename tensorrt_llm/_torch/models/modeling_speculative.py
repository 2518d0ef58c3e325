"""The Eagle3 drafter: one decoder layer over [embedding, fused target features], a draft vocabulary.

Per position p the drafter sees the target's hidden states at p from three layers (fused 3H -> H by
``fc``) and the embedding of token p+1, and predicts token p+2::

    x_p   = [input_layernorm(embed(t_{p+1})) ; hidden_norm(f_p)]             # [2H]
    h_p   = f_p + o_proj(attn(x_p)) ;  h_p = h_p + mlp(post_attention_layernorm(h_p))
    draft = lm_head(norm(h_p))  over draft_vocab_size tokens; target id = d + d2t[d]

``f_p`` is ``fc(target features)`` on the first draft step and the drafter's own ``h`` of the
previous step afterwards (chain drafting). The layer's KV (its own head count and head_dim) is
cached like any layer's, under the layer id that follows the target's layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.utils import get_attention_backend
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.config_utils import (
    check_positive_ints,
    known_kwargs,
    read_config_json,
)
from tensorrt_llm._torch.models.weights import PlainLayout
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP
from tensorrt_llm._torch.modules.linear import ColumnParallelLinear, RowParallelLinear
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.modules.rotary_embedding import apply_partial_rope

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    """An HF-Eagle3-style ``config.json`` (the keys this drafter reads)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    eagle3_layers_to_capture: tuple[int, ...] | None = None
    tie_word_embeddings: bool = False  # its LM head is its own (the embedding is the target's)
    architectures: tuple[str, ...] = field(default=(EAGLE3_ARCHITECTURE,))

    def __post_init__(self) -> None:
        check_positive_ints(self, "draft config.json")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "draft config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft config.json: draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Eagle3Config:
        kwargs = known_kwargs(cls, data, "draft config.json")
        for key in ("architectures", "eagle3_layers_to_capture"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(kwargs[key])
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Eagle3Config:
        return cls.from_dict(read_config_json(model_dir, "speculative_model"))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["architectures"] = list(self.architectures)
        if self.eagle3_layers_to_capture is not None:
            data["eagle3_layers_to_capture"] = list(self.eagle3_layers_to_capture)
        return data


class Eagle3TargetConfig(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...


class Eagle3TargetBody(Protocol):
    @property
    def embed_tokens(self) -> nn.Embedding: ...


class Eagle3Target(Protocol):
    """All the drafter needs of its target, whatever the architecture: the vocabulary and hidden
    sizes it must match, and the token embedding it shares (``target.model.embed_tokens``)."""

    @property
    def config(self) -> Eagle3TargetConfig: ...

    @property
    def model(self) -> Eagle3TargetBody: ...


def default_layers_to_capture(num_target_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers: (1, L/2 - 1, L - 4) as upstream, clamped for tiny models
    to three distinct layers where possible."""
    if num_target_layers >= 6:
        return (1, num_target_layers // 2 - 1, num_target_layers - 4)
    picks = sorted({0, num_target_layers // 2, num_target_layers - 1})
    while len(picks) < 3:
        picks.append(picks[-1])
    return tuple(picks)


class Eagle3Attention(nn.Module):
    """Split over the tensor-parallel ranks like the target's attention: each rank's drafter heads
    keep their KV in that rank's slots (the sub-page view is per rank)."""

    def __init__(self, cfg: Eagle3Config, layer_idx: int, mapping: Mapping) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = mapping.shard(cfg.num_attention_heads, "draft num_attention_heads")
        what = "draft num_key_value_heads"
        self.num_kv_heads, *kv_shards = mapping.kv_head_shard(cfg.num_key_value_heads, what)
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.scale = 1.0 / math.sqrt(self.head_dim)
        x_size, q_size = 2 * cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = ColumnParallelLinear(x_size, q_size, mapping, "draft num_attention_heads")
        self.k_proj = ColumnParallelLinear(x_size, kv_size, mapping, what, shards=tuple(kv_shards))
        self.v_proj = ColumnParallelLinear(x_size, kv_size, mapping, what, shards=tuple(kv_shards))
        self.o_proj = RowParallelLinear(
            q_size, cfg.hidden_size, mapping, "draft num_attention_heads"
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata | None,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """``x [..., 2H]`` -> ``[..., H]``."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        q = apply_partial_rope(q, positions, self.head_dim, self.rope_theta)
        k = apply_partial_rope(k, positions, self.head_dim, self.rope_theta)
        out = backend.attention(self.layer_idx, q, k, v, metadata, self.scale)
        return self.o_proj(out.flatten(-2))


class Eagle3DraftModel(nn.Module):
    checkpoint_layout = PlainLayout  # checkpoint names are the state_dict's

    def __init__(
        self,
        cfg: Eagle3Config,
        layer_idx: int,
        attn_backend: AttentionBackend | None = None,
        mapping: Mapping | None = None,
    ) -> None:
        super().__init__()
        mapping = mapping or Mapping()
        self.config = cfg
        self.layer_idx = layer_idx
        self.attn_backend = attn_backend or get_attention_backend("VANILLA")
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.midlayer.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.midlayer.self_attn = Eagle3Attention(cfg, layer_idx, mapping)
        self.midlayer.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.midlayer.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, mapping)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(
            cfg.hidden_size, cfg.draft_vocab_size, mapping, "draft_vocab_size", gather_output=True
        )
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: nn.Embedding | None = None  # shared with the target (set by the loader)

    def fuse(
        self, captured: list[torch.Tensor], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Three captured target hidden states ``[..., H]`` -> the first step's features ``[..., H]``
        (``input_ids``, the step's tokens, are not needed)."""
        return self.fc(torch.cat(captured, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` (token p+1 at position p) and ``features`` ``[..., H]`` -> the drafter's hidden
        ``h`` (the next step's features) and draft-vocabulary logits; of ``rows`` only when given
        (every position's KV is written)."""
        layer = self.midlayer
        embeds = self.embed_tokens(input_ids).to(features.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
        hidden = features + layer.self_attn(x, positions, attn_metadata, self.attn_backend)
        if rows is not None:
            hidden = hidden[rows]
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, self.lm_head(self.norm(hidden)).float()

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    def exchanging_blocks(self) -> list:
        return []  # (no MoE)

    def idle(self, capacity: int | None) -> None:
        """A chain step without rows on this rank: nothing is exchanged."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_probs(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary probabilities ``[..., Vd]`` scattered onto the target vocabulary."""
        out = torch.zeros(*probs.shape[:-1], vocab_size, dtype=probs.dtype, device=probs.device)
        index = self.to_target_ids(torch.arange(probs.shape[-1], device=probs.device)).expand_as(
            probs
        )
        return out.scatter_(-1, index, probs)
