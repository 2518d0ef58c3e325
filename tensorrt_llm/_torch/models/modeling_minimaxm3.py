"""The published MiniMax-M3 (transformers' ``minimax_m3_vl`` text model), at any size.

Per layer ``i`` (``configuration_minimaxm3.py`` reads the config)::

    h = x + o_proj(attn(input_layernorm(x)))          full or sparse: layer_types[i]
    y = h + mlp(post_attention_layernorm(h))          dense or MoE:  mlp_layer_types[i]

- every norm is a Gemma RMSNorm (``x_hat * (1 + w)`` in fp32): layer norms, final norm, the
  per-head QK norms and the indexer's norms;
- attention: q/k/v projections, per-head QK norm, then NeoX RoPE on the leading
  ``int(head_dim * partial_rotary_factor)`` channels, GQA;
- a sparse layer adds the lightning indexer: ``index_q_proj`` (one index head per KV group),
  ``index_k_proj`` (one index-K head), their norms and the same RoPE; the attention then runs
  through MiniMax-M3's MSA backend (``sparse/minimax_m3/``), which caches the post-RoPE index-K;
- dense MLPs and the MoE's experts are SwiGLU-OAI (``modules/gated_mlp.py``, ``modules/moe.py``).

Every dense attention layer calls the model's ``attn_backend``; every sparse one the MSA backend
that goes with it (``msa_backend_for``):
- ``forward(input_ids [num_tokens], position_ids, attn_metadata)`` on a paged backend reads and
  writes KV only through the manager attached to ``attn_metadata``;
- ``forward(input_ids [B, T])`` with no metadata runs whole sequences from position 0 under the
  training backend (``tensorrt_llm._torch.training.use_training_backend``): training.

A VL checkpoint adds the vision tower and projector (``modeling_minimaxm3_vision.py``):
``encode_images`` turns image patches into one embedding per image token, and ``forward(...,
multimodal=(rows, embeddings))`` puts them in place of those rows' token embeddings.

Both return hidden states after the final norm; ``compute_logits`` applies the LM head. Hidden states
of chosen layers can be captured (``capture_layers``) for an Eagle3 drafter. How the hub's and
transformers' checkpoint names map onto these modules: ``checkpoint_minimaxm3.py``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import MsaInputs
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa_backend import msa_backend_for
from tensorrt_llm._torch.attention_backend.utils import get_attention_backend
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.checkpoint_minimaxm3 import MiniMaxM3CheckpointLayout
from tensorrt_llm._torch.models.configuration_minimaxm3 import MOE_MLP, MiniMaxM3Config
from tensorrt_llm._torch.models.modeling_minimaxm3_mtp import MiniMaxM3MTP
from tensorrt_llm._torch.models.modeling_minimaxm3_vision import (
    MiniMaxM3MultiModalProjector,
    MiniMaxM3VisionModel,
)
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP, SwigluOai
from tensorrt_llm._torch.modules.linear import ColumnParallelLinear, RowParallelLinear
from tensorrt_llm._torch.modules.moe import MiniMaxM3SparseMoeBlock
from tensorrt_llm._torch.modules.rms_norm import GemmaRMSNorm
from tensorrt_llm._torch.modules.rotary_embedding import apply_partial_rope


class MiniMaxM3Attention(nn.Module):
    """Attention over this rank's heads: Q, K, V split by head (column-parallel), the output
    projection row-parallel (all-reduced). A sparse layer's indexer is replicated: the blocks a KV
    group attends are the same whichever rank holds the group."""

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
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.is_sparse = layer_idx in cfg.sparse_layer_ids
        if self.is_sparse:
            index_dim = cfg.index_head_dim
            self.index_q_proj = nn.Linear(hidden, cfg.index_n_heads * index_dim, bias=False)
            self.index_k_proj = nn.Linear(hidden, index_dim, bias=False)
            self.index_q_norm = GemmaRMSNorm(index_dim, cfg.rms_norm_eps)
            self.index_k_norm = GemmaRMSNorm(index_dim, cfg.rms_norm_eps)
            num_shards, shard = kv_shards
            first = shard * self.num_kv_heads  # the global KV groups this rank attends
            self.index_heads = slice(first, first + self.num_kv_heads)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_partial_rope(x, positions, self.cfg.rotary_dim, self.cfg.rope_theta)

    def indexer(self, hidden: torch.Tensor, positions: torch.Tensor) -> MsaInputs:
        """Index q of this rank's KV groups ``[..., Hkv, Di]`` and index-K ``[..., 1, Di]``, both
        normed and rotated."""
        cfg = self.cfg
        iq = self.index_q_proj(hidden).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        ik = self.index_k_proj(hidden).unsqueeze(-2)
        iq = self.rope(self.index_q_norm(iq), positions)[..., self.index_heads, :]
        return MsaInputs(index_q=iq, index_k=self.rope(self.index_k_norm(ik), positions))

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata | None,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q = self.q_proj(hidden).unflatten(-1, (self.num_heads, self.head_dim))  # [..., H, D]
        k = self.k_proj(hidden).unflatten(-1, (self.num_kv_heads, self.head_dim))  # [..., Hkv, D]
        v = self.v_proj(hidden).unflatten(-1, (self.num_kv_heads, self.head_dim))
        q = self.rope(self.q_norm(q), positions)
        k = self.rope(self.k_norm(k), positions)
        if self.is_sparse:
            msa = self.indexer(hidden, positions)
            out = msa_backend_for(backend).attend(
                self.layer_idx, q, k, v, msa, metadata, self.cfg.msa, self.scale
            )
        else:
            out = backend.attention(self.layer_idx, q, k, v, metadata, self.scale)
        return self.o_proj(out.flatten(-2))


class MiniMaxM3DecoderLayer(nn.Module):
    def __init__(self, cfg: MiniMaxM3Config, layer_idx: int, mapping: Mapping) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MiniMaxM3Attention(cfg, layer_idx, mapping)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        glu = SwigluOai(cfg.swiglu_alpha, cfg.swiglu_limit)
        if cfg.mlp_layer_types[layer_idx] == MOE_MLP:
            self.mlp = MiniMaxM3SparseMoeBlock(cfg.hidden_size, cfg.moe, mapping, glu)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, mapping, glu)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata | None,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rows``: only these rows go on past the attention (an MTP module's first draft step
        writes every position's KV but needs its output at one position per sequence)."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, metadata, backend)
        if rows is not None:
            hidden = hidden[rows]
        normed = self.post_attention_layernorm(hidden)
        if isinstance(self.mlp, MiniMaxM3SparseMoeBlock):  # (the step's exchange between ranks)
            return hidden + self.mlp(normed, metadata.moe_capacity if metadata else None)
        return hidden + self.mlp(normed)


class MiniMaxM3Model(nn.Module):
    def __init__(self, cfg: MiniMaxM3Config, mapping: Mapping) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated
        self.layers = nn.ModuleList(
            MiniMaxM3DecoderLayer(cfg, i, mapping) for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MiniMaxM3ForCausalLM(nn.Module):
    checkpoint_layout = MiniMaxM3CheckpointLayout  # the hub's names and transformers'

    def __init__(
        self,
        cfg: MiniMaxM3Config,
        attn_backend: AttentionBackend | None = None,
        mapping: Mapping | None = None,
        num_mtp_modules: int = 0,
    ) -> None:
        """``num_mtp_modules``: the checkpoint's MTP modules to build (and load) beside the
        target, as a drafter (``modeling_minimaxm3_mtp.py``)."""
        super().__init__()
        mapping = mapping or Mapping()
        self.config = cfg
        self.mapping = mapping
        # Every attention layer calls it; replaceable (``use_training_backend``). Not a parameter.
        self.attn_backend = attn_backend or get_attention_backend("VANILLA")
        self.model = MiniMaxM3Model(cfg, mapping)
        if num_mtp_modules:
            if num_mtp_modules > cfg.num_mtp_modules:
                raise ValueError(
                    f"{num_mtp_modules} MTP module(s) asked for; the checkpoint's config has "
                    f"num_mtp_modules={cfg.num_mtp_modules} (a standalone MTP checkpoint can "
                    "give them: speculative_config.speculative_model)"
                )
            self.model.mtp = MiniMaxM3MTP(cfg, num_mtp_modules, mapping, MiniMaxM3DecoderLayer)
        # vocabulary-parallel, gathered: every rank gets the full logits (and samples the same)
        self.lm_head = ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, mapping, "vocab_size", gather_output=True
        )
        if cfg.tie_word_embeddings and mapping.attn_tp_size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.vision is not None:  # replicated on every rank
            self.vision_tower = MiniMaxM3VisionModel(cfg.vision)
            self.multi_modal_projector = MiniMaxM3MultiModalProjector(cfg.vision)

    def encode_images(
        self, patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Each image's token embeddings ``[num_image_tokens, hidden]`` (in the model's dtype) from
        the patches of all of them, concatenated ``[num_patches, C*T*P*P]``."""
        features = self.multi_modal_projector(self.vision_tower(patches, grid_thw))
        merge = self.config.vision.merge_area
        return list(features.split([t * h * w // merge for t, h, w in grid_thw]))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_metadata: AttentionMetadata | None = None,
        capture_layers: tuple[int, ...] = (),
        multimodal: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states after the final norm, and the outputs of ``capture_layers`` (in that order;
        layer ``num_hidden_layers`` is the final norm's output and layer -1 the input embeddings,
        images merged: an MTP module's inputs).
        ``multimodal``: ``(rows [n], embeddings [n, hidden])`` replace those rows' token embeddings.

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
        if multimodal is not None:
            rows, embeddings = multimodal
            hidden = hidden.index_copy(0, rows, embeddings.to(hidden.dtype))
        captured: dict[int, torch.Tensor] = {-1: hidden}
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, position_ids, attn_metadata, self.attn_backend)
            if i in capture_layers:
                captured[i] = hidden
        captured[len(self.model.layers)] = hidden = self.model.norm(hidden)
        return hidden, [captured[i] for i in capture_layers]

    def mtp_hidden(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        """MTP module ``index``'s hidden states (before its final norm) at each position: from
        the token after it (``next_ids``, shaped as ``input_ids``) and the target's final hidden
        state there (or, for a later draft step, the module's own output)."""
        layer = self.model.mtp.layers[index]
        embeddings = self.model.embed_tokens(next_ids)
        return layer(embeddings, hidden, position_ids, attn_metadata, self.attn_backend)

    def mtp_logits(self, hidden: torch.Tensor, index: int = 0) -> torch.Tensor:
        """``[n, V]`` float32 logits of MTP module ``index``'s hidden states."""
        return self.lm_head(self.model.mtp.layers[index].final_layernorm(hidden)).float()

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, V]`` float32 logits; written into ``out`` when given (the CUDA graphs' shared
        buffer)."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)
