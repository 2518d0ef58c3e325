"""MSA over whole sequences without a cache (training), and the indexer's training loss.

The paged inference path is ``attention_backend/sparse/minimax_m3/msa.py``; this one sees every
query of ``[B, T]`` sequences from position 0 at once, so block selection becomes a token mask per
KV group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (
    MsaConfig,
    MsaInputs,
    block_key_mask,
    select_blocks,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa_backend import (
    MSA_BACKENDS,
    MsaBackend,
)
from tensorrt_llm._torch.training.backend import TrainingAttentionBackend, check_no_cache


class TrainingMsaBackend(MsaBackend):
    """The training backend's sparse layers: dense or sparse per ``attn_backend.msa_sparse``, the
    indexer's loss into ``attn_backend.indexer_losses`` when ``train_indexer``."""

    attn_backend: TrainingAttentionBackend

    def attend(self, layer_idx, q, k, v, msa, metadata, cfg, scale):
        check_no_cache(metadata)
        backend = self.attn_backend
        out, loss = msa_dense_attention(
            q, k, v, msa, cfg, scale, backend.msa_sparse, backend.train_indexer
        )
        if loss is None:
            backend.indexer_losses.pop(layer_idx, None)
        else:
            backend.indexer_losses[layer_idx] = loss
        return out


MSA_BACKENDS[TrainingAttentionBackend.name] = TrainingMsaBackend


def token_index_scores(msa: MsaInputs) -> torch.Tensor:
    """``index_q [B, T, G, Di]``, ``index_k [B, T, 1, Di]`` -> raw fp32 dot products of every query
    with every key, causal (-inf above the diagonal): ``[B, G, T, T]``."""
    length = msa.index_q.shape[1]
    scores = torch.einsum("btgd,bsd->bgts", msa.index_q.float(), msa.index_k[:, :, 0].float())
    pos = torch.arange(length, device=scores.device)
    return scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))


def block_max(token_scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[..., T]`` -> ``[..., cdiv(T, block_size)]``: the max over each block's keys."""
    length = token_scores.shape[-1]
    num_blocks = -(-length // block_size)
    padded = F.pad(token_scores, (0, num_blocks * block_size - length), value=float("-inf"))
    return padded.unflatten(-1, (num_blocks, block_size)).amax(-1)


def msa_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    msa: MsaInputs,
    cfg: MsaConfig,
    scale: float,
    sparse: bool = True,
    want_indexer_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MSA over whole sequences from position 0: ``q [B, T, H, D]``, ``k, v [B, T, Hkv, D]``,
    ``msa.index_q [B, T, Hkv, Di]``, ``msa.index_k [B, T, 1, Di]``.

    With ``sparse`` each query head attends only the blocks its KV group selected (a token mask
    from ``select_blocks``), else every earlier key. With ``want_indexer_loss`` also returns the
    indexer's training loss (``indexer_training_loss``). Returns ``out [B, T, H, D]`` and the loss
    or ``None``.
    """
    batch, length, num_heads, _ = q.shape
    num_groups = k.shape[2]
    groups = num_heads // num_groups
    pos = torch.arange(length, device=q.device)
    causal = pos[None, :] <= pos[:, None]  # [T, T]
    token_scores = token_index_scores(msa)  # [B, G, T, T]
    qh = q.transpose(1, 2)  # [B, H, T, D]
    kh = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    if sparse:
        block_scores = block_max(token_scores.detach(), cfg.block_size)  # [B, G, T, NB]
        flat = block_scores.transpose(1, 2).reshape(batch * length, num_groups, -1)
        selected = select_blocks(flat, pos.repeat(batch), cfg)  # [B*T, G, NB]
        keys = block_key_mask(selected, length, cfg.block_size)  # [B*T, G, T]
        mask = keys.view(batch, length, num_groups, length).transpose(1, 2) & causal
        mask = mask.repeat_interleave(groups, dim=1)  # [B, H, T, T]
    else:
        mask = causal.expand(batch, 1, length, length)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(1, 2)
    if not want_indexer_loss:
        return out, None
    return out, indexer_training_loss(qh, kh, token_scores, cfg, scale)


def indexer_training_loss(
    qh: torch.Tensor, kh: torch.Tensor, token_scores: torch.Tensor, cfg: MsaConfig, scale: float
) -> torch.Tensor:
    """Per KV group, the cross-entropy from the dense attention's mass per key block (averaged over
    the group's query heads, no gradient) to the softmax of the group's index-head block scores,
    over the blocks a query can see; averaged over groups and queries.

    ``qh, kh [B, H, T, D]`` (K already repeated to the query heads), ``token_scores [B, G, T, T]``.
    """
    batch, num_heads, length, _ = qh.shape
    num_groups = token_scores.shape[1]
    pos = torch.arange(length, device=qh.device)
    causal = pos[None, :] <= pos[:, None]  # [T, T]
    with torch.no_grad():
        logits = (qh.float() @ kh.float().transpose(-1, -2)) * scale
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # [B, H, T, T]
        per_group = probs.view(batch, num_groups, num_heads // num_groups, length, length).mean(2)
        num_blocks = -(-length // cfg.block_size)
        mass = F.pad(per_group, (0, num_blocks * cfg.block_size - length)).unflatten(
            -1, (num_blocks, cfg.block_size)
        )
        mass = mass.sum(-1)  # [B, G, T, NB]
    block_scores = block_max(token_scores, cfg.block_size)  # [B, G, T, NB]
    visible = (
        torch.arange(num_blocks, device=qh.device)[None, :] <= (pos // cfg.block_size)[:, None]
    )
    log_p = torch.log_softmax(block_scores.masked_fill(~visible, float("-inf")), dim=-1)
    return -(mass * log_p.masked_fill(~visible, 0.0)).sum(-1).mean()
