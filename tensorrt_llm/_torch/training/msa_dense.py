"""MSA over whole sequences without a cache (training), and the indexer's training loss.

The paged inference path is ``attention_backend/sparse/minimax_m3/msa.py``; this one sees every
query of ``[B, T]`` sequences from position 0 at once, so block selection becomes a token mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (
    MsaConfig,
    MsaInputs,
    select_blocks,
)


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
    ``msa.index_q [B, T, Hi, Di]``, ``msa.index_w [B, T, Hi]``, ``msa.index_k [B, T, 1, Di]``.

    With ``sparse`` each query attends only its selected blocks (a token mask from
    ``select_blocks``), else every earlier key. With ``want_indexer_loss`` also returns the indexer's
    training loss (``indexer_training_loss``). Returns ``out [B, T, H, D]`` and the loss or ``None``.
    """
    batch, length, num_heads, _ = q.shape
    bs = cfg.block_size
    num_blocks = -(-length // bs)
    pos = torch.arange(length, device=q.device)
    causal = pos[None, :] <= pos[:, None]  # [T, T]
    dots = torch.einsum(
        "bthd,bsd->bths", msa.index_q.float(), msa.index_k[:, :, 0].float()
    ) / math.sqrt(msa.index_q.shape[-1])
    token_scores = torch.einsum("bths,bth->bts", torch.relu(dots), msa.index_w.float())  # [B, T, T]
    if sparse:
        selected = select_blocks(
            token_scores.detach().reshape(batch * length, length), pos.repeat(batch), cfg
        )
        mask = (
            selected.view(batch, length, num_blocks).repeat_interleave(bs, dim=-1)[..., :length]
            & causal
        )
    else:
        mask = causal.expand(batch, length, length)
    groups = num_heads // k.shape[2]
    qh = q.transpose(1, 2)  # [B, H, T, D]
    kh = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask[:, None], scale=scale
    ).transpose(1, 2)
    if not want_indexer_loss:
        return out, None
    return out, indexer_training_loss(qh, kh, token_scores, cfg, scale)


def indexer_training_loss(
    qh: torch.Tensor, kh: torch.Tensor, token_scores: torch.Tensor, cfg: MsaConfig, scale: float
) -> torch.Tensor:
    """The cross-entropy from the dense attention's mass per key block (averaged over heads, no
    gradient) to the softmax of the indexer's block scores, over the blocks a query can see.

    ``qh, kh [B, H, T, D]`` (K already repeated to the query heads), ``token_scores [B, T, T]``.
    """
    batch, _, length, _ = qh.shape
    bs = cfg.block_size
    num_blocks = -(-length // bs)
    pos = torch.arange(length, device=qh.device)
    causal = pos[None, :] <= pos[:, None]  # [T, T]
    with torch.no_grad():
        probs = torch.softmax(
            (qh.float() @ kh.float().transpose(-1, -2) * scale).masked_fill(~causal, float("-inf")),
            -1,
        )
        mass = (
            F.pad(probs.mean(dim=1), (0, num_blocks * bs - length))
            .view(batch, length, num_blocks, bs)
            .sum(-1)
        )  # [B, T, num_blocks]
    padded = F.pad(
        token_scores.masked_fill(~causal, float("-inf")),
        (0, num_blocks * bs - length),
        value=float("-inf"),
    )
    block_scores = padded.view(batch, length, num_blocks, bs).amax(-1)  # [B, T, num_blocks]
    visible = (
        torch.arange(num_blocks, device=qh.device)[None, :] <= (pos // bs)[:, None]
    )  # [T, num_blocks]
    log_p = torch.log_softmax(block_scores.masked_fill(~visible, float("-inf")), dim=-1)
    return -(mass * log_p.masked_fill(~visible, 0.0)).sum(-1).mean()
