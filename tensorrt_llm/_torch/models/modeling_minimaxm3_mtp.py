"""MiniMax-M3's multi-token-prediction (MTP) modules: the checkpoint's own draft head.

At position ``t`` a module takes the embedding of token ``t + 1`` (zero at position 0) and the
target's hidden state at ``t`` (after the final norm)::

    x = eh_proj(cat([enorm(embedding), hnorm(hidden)]))       the embedding first
    h = transformer_layer(x)                                   sparse attention and an MoE
    logits = lm_head(final_layernorm(h))                       the target's LM head

``h`` (before the final norm) is also the next draft step's hidden: one module replayed for every
draft step. The transformer layer is a target decoder layer forced to sparse attention (its own
lightning indexer and index-K) and to the MoE, with the layer id after the target's
(``num_hidden_layers + i``): to the KV cache it is one more sparse layer. The hub keeps the modules
under ``language_model.model.mtp.layers.{i}.*`` (``checkpoint_minimaxm3.py``); embedding and LM
head are the target's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.configuration_minimaxm3 import MOE_MLP, SPARSE, MiniMaxM3Config
from tensorrt_llm._torch.modules.linear import Fp8BlockLinear
from tensorrt_llm._torch.modules.rms_norm import GemmaRMSNorm


def mtp_layer_config(cfg: MiniMaxM3Config, num_modules: int) -> MiniMaxM3Config:
    """``cfg`` with the MTP modules' layers after the target's: sparse attention, MoE MLPs."""
    return dataclasses.replace(
        cfg,
        num_hidden_layers=cfg.num_hidden_layers + num_modules,
        layer_types=(*cfg.layer_types, *(SPARSE,) * num_modules),
        mlp_layer_types=(*cfg.mlp_layer_types, *(MOE_MLP,) * num_modules),
    )


def mtp_kv_cache_layer(cfg: MiniMaxM3Config, index: int = 0, mapping: Mapping | None = None):
    """What module ``index``'s layer caches per token on a rank: one more sparse layer."""
    return mtp_layer_config(cfg, index + 1).kv_cache_layers(mapping)[-1]


class MiniMaxM3MTPLayer(nn.Module):
    def __init__(
        self, cfg: MiniMaxM3Config, index: int, mapping: Mapping, decoder_layer: type[nn.Module]
    ) -> None:
        """``decoder_layer``: the target's decoder layer class (``MiniMaxM3DecoderLayer``)."""
        super().__init__()
        hidden = cfg.hidden_size
        self.layer_idx = cfg.num_hidden_layers + index  # (the KV cache's layer id)
        self.enorm = GemmaRMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = GemmaRMSNorm(hidden, cfg.rms_norm_eps)
        # replicated; FP8 with block scales where the checkpoint's projections are
        self.eh_proj = Fp8BlockLinear(2 * hidden, hidden, bias=False)
        layer_cfg = mtp_layer_config(cfg, index + 1)
        self.transformer_layer = decoder_layer(layer_cfg, self.layer_idx, mapping)
        self.final_layernorm = GemmaRMSNorm(hidden, cfg.rms_norm_eps)

    def forward(
        self,
        embeddings: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata | None,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``h`` of the module docstring, before the final norm (of ``rows`` only, when given:
        every position's KV is written)."""
        embeddings = torch.where(positions.unsqueeze(-1) == 0, 0, embeddings)
        x = self.eh_proj.matmul(torch.cat([self.enorm(embeddings), self.hnorm(hidden)], dim=-1))
        return self.transformer_layer(x, positions, metadata, backend, rows)


class MiniMaxM3MTP(nn.Module):
    """The checkpoint's MTP modules (``mtp.layers.{i}``)."""

    def __init__(
        self,
        cfg: MiniMaxM3Config,
        num_modules: int,
        mapping: Mapping,
        decoder_layer: type[nn.Module],
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            MiniMaxM3MTPLayer(cfg, i, mapping, decoder_layer) for i in range(num_modules)
        )
