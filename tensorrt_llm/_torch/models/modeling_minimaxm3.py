"""MiniMax-M3 architecture at any size: dense first layers, MSA after; GQA, partial RoPE, QK RMSNorm.

Every attention layer calls the model's ``attn_backend`` (``attention_backend/interface.py``):
- ``forward(input_ids [num_tokens], position_ids, attn_metadata)`` on a paged backend (``VANILLA``,
  the default) reads and writes KV only through the manager attached to ``attn_metadata``;
- ``forward(input_ids [B, T])`` with no metadata runs whole sequences from position 0 under the
  training backend (``tensorrt_llm._torch.training.use_training_backend``): training, and the oracle.

Both return hidden states after the final norm; ``compute_logits`` applies the LM head. Hidden states
of chosen layers can be captured (``capture_layers``) for an Eagle3 drafter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import MsaConfig, MsaInputs
from tensorrt_llm._torch.attention_backend.utils import get_attention_backend
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.config_utils import (
    check_positive_ints,
    known_kwargs,
    read_config_json,
)
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP
from tensorrt_llm._torch.modules.linear import ColumnParallelLinear, RowParallelLinear
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.modules.rotary_embedding import apply_partial_rope
from tensorrt_llm._torch.pyexecutor.config import KvCacheLayer

MODEL_TYPE = "minimax_m3"
ARCHITECTURE = "MiniMaxM3ForCausalLM"


@dataclass(frozen=True)
class MiniMaxM3Config:
    """The keys of a MiniMax-M3 ``config.json`` this implementation reads (others are ignored)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    use_qk_norm: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    torch_dtype: str = "float32"
    sparse_attention_config: MsaConfig | None = None
    architectures: tuple[str, ...] = field(default=(ARCHITECTURE,))
    model_type: str = MODEL_TYPE

    def __post_init__(self) -> None:
        check_positive_ints(self, "config.json")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"config.json: rotary_dim={self.rotary_dim} must be even and <= head_dim={self.head_dim}"
            )
        if self.model_type != MODEL_TYPE:
            raise ValueError(
                f"config.json: model_type={self.model_type!r}, expected {MODEL_TYPE!r}"
            )
        if (
            self.sparse_attention_config
            and self.sparse_attention_config.num_dense_layers > self.num_hidden_layers
        ):
            raise ValueError(
                "config.json: sparse_attention_config.num_dense_layers exceeds num_hidden_layers"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MiniMaxM3Config:
        kwargs = known_kwargs(cls, data, "config.json")
        sparse = kwargs.get("sparse_attention_config")
        if isinstance(sparse, dict):
            unknown = sorted(set(sparse) - {f.name for f in fields(MsaConfig)})
            if unknown:
                raise ValueError(
                    f"config.json: sparse_attention_config has unknown key(s) {unknown}"
                )
            kwargs["sparse_attention_config"] = MsaConfig(**sparse)
        if "architectures" in kwargs:
            kwargs["architectures"] = tuple(kwargs["architectures"])
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> MiniMaxM3Config:
        return cls.from_dict(read_config_json(model_dir, "model"))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["architectures"] = list(self.architectures)
        return data

    @property
    def sparse_layer_ids(self) -> tuple[int, ...]:
        """Target layers that use MSA (and so cache an index-K)."""
        if self.sparse_attention_config is None:
            return ()
        return tuple(range(self.sparse_attention_config.num_dense_layers, self.num_hidden_layers))

    def kv_cache_layers(self, mapping: Mapping | None = None) -> tuple[KvCacheLayer, ...]:
        """What each layer caches per token on one rank: its share of the KV heads, plus one
        index-K head on MSA layers (the indexer is replicated, so every rank caches it)."""
        msa, sparse = self.sparse_attention_config, set(self.sparse_layer_ids)
        mapping = mapping or Mapping()
        num_kv_heads = mapping.kv_head_shard(self.num_key_value_heads, "num_key_value_heads")[0]
        return tuple(
            KvCacheLayer(
                num_kv_heads,
                self.head_dim,
                index_head_dim=msa.index_head_dim if i in sparse else 0,
            )
            for i in range(self.num_hidden_layers)
        )


class Indexer(nn.Module):
    """MSA's light indexer: ``index_n_heads`` query heads, one shared key head, per-head weights.

    Replicated on every tensor-parallel rank: the blocks it selects must be the same for every
    rank's heads, and splitting its heads would add an all-reduce of the block scores per layer."""

    def __init__(self, cfg: MiniMaxM3Config) -> None:
        super().__init__()
        msa = cfg.sparse_attention_config
        self.num_heads, self.head_dim = msa.index_n_heads, msa.index_head_dim
        self.wq = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)

    def forward(self, hidden: torch.Tensor) -> MsaInputs:
        """``hidden [..., hidden_size]`` -> index_q ``[..., Hi, Di]``, index_w ``[..., Hi]``,
        index_k ``[..., 1, Di]``."""
        q = self.wq(hidden).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.wk(hidden).unsqueeze(-2)
        w = self.weights_proj(hidden) / math.sqrt(self.num_heads)
        return MsaInputs(index_q=q, index_w=w, index_k=k)


class MiniMaxM3Attention(nn.Module):
    """Attention over this rank's heads: Q, K, V split by head (column-parallel), the output
    projection row-parallel (all-reduced)."""

    def __init__(self, cfg: MiniMaxM3Config, layer_idx: int, mapping: Mapping) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.num_heads = mapping.shard(cfg.num_attention_heads, "num_attention_heads")
        what = "num_key_value_heads"
        self.num_kv_heads, *kv_shards = mapping.kv_head_shard(cfg.num_key_value_heads, what)
        self.head_dim = cfg.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        hidden, q_size = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = ColumnParallelLinear(hidden, q_size, mapping, "num_attention_heads")
        self.k_proj = ColumnParallelLinear(hidden, kv_size, mapping, what, shards=tuple(kv_shards))
        self.v_proj = ColumnParallelLinear(hidden, kv_size, mapping, what, shards=tuple(kv_shards))
        self.o_proj = RowParallelLinear(q_size, hidden, mapping, "num_attention_heads")
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.is_sparse = layer_idx in cfg.sparse_layer_ids
        if self.is_sparse:
            self.indexer = Indexer(cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata | None,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q = self.q_proj(hidden).unflatten(-1, (self.num_heads, self.head_dim))  # [..., T, H, D]
        k = self.k_proj(hidden).unflatten(
            -1, (self.num_kv_heads, self.head_dim)
        )  # [..., T, Hkv, D]
        v = self.v_proj(hidden).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.cfg.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_partial_rope(q, positions, self.cfg.rotary_dim, self.cfg.rope_theta)
        k = apply_partial_rope(k, positions, self.cfg.rotary_dim, self.cfg.rope_theta)
        if self.is_sparse:
            msa = self.indexer(hidden)
            cfg = self.cfg.sparse_attention_config
            out = backend.msa_attention(self.layer_idx, q, k, v, msa, metadata, cfg, self.scale)
        else:
            out = backend.attention(self.layer_idx, q, k, v, metadata, self.scale)
        return self.o_proj(out.flatten(-2))


class MiniMaxM3DecoderLayer(nn.Module):
    def __init__(self, cfg: MiniMaxM3Config, layer_idx: int, mapping: Mapping) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MiniMaxM3Attention(cfg, layer_idx, mapping)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, mapping)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata | None,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), positions, metadata, backend)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MiniMaxM3Model(nn.Module):
    def __init__(self, cfg: MiniMaxM3Config, mapping: Mapping) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated
        self.layers = nn.ModuleList(
            MiniMaxM3DecoderLayer(cfg, i, mapping) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MiniMaxM3ForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: MiniMaxM3Config,
        attn_backend: AttentionBackend | None = None,
        mapping: Mapping | None = None,
    ) -> None:
        super().__init__()
        mapping = mapping or Mapping()
        self.config = cfg
        self.mapping = mapping
        # Every attention layer calls it; replaceable (``use_training_backend``). Not a parameter.
        self.attn_backend = attn_backend or get_attention_backend("VANILLA")
        self.model = MiniMaxM3Model(cfg, mapping)
        # vocabulary-parallel, gathered: every rank gets the full logits (and samples the same)
        self.lm_head = ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, mapping, "vocab_size", gather_output=True
        )
        if cfg.tie_word_embeddings and mapping.attn_tp_size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_metadata: AttentionMetadata | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states after the final norm, and the outputs of ``capture_layers`` (in that order).

        With metadata: ``input_ids [num_tokens]``, positions default to ``attn_metadata.position_ids``.
        Without (the training backend): ``input_ids [B, T]``, positions default to ``0..T-1``.
        """
        if position_ids is None:
            if attn_metadata is None:
                position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(
                    input_ids
                )
            else:
                position_ids = attn_metadata.position_ids.to(input_ids.device)
        hidden = self.model.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, position_ids, attn_metadata, self.attn_backend)
            if i in capture_layers:
                captured[i] = hidden
        return self.model.norm(hidden), [captured[i] for i in capture_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
