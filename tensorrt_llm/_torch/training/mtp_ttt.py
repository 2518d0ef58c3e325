"""MTP training-time test (TTT): every position starts a whole chain of the MTP module in one pass
per step, as the one-model worker replays the module at inference (``speculative/mtp.py``).

Step ``i`` at row ``s`` is chain step ``i`` of a draft that starts after position ``s``: input
token ``s + i + 1`` (teacher-forced) at position ``s + i``; the hidden state is the target's after
its final norm at ``s`` (step 0) or the module's own ``h`` of step ``i - 1`` at row ``s``. Its query
sees step 0's keys at positions ``<= s`` (what the cache holds for accepted positions) and its own
chain's keys (steps 1..i at row ``s``). Step ``i`` at row ``s`` predicts token ``s + i + 2``.

Step 0 is the module's sparse layer over whole sequences (``msa_dense``: dense or sparse per the
backend's knob, the indexer's loss when asked); later steps attend densely over those keys, which
is what sparse selection gives while a sequence spans no more blocks than it keeps.
``tests/unittest/_torch/training/test_mtp_ttt.py`` pins the steps against real chained drafting
through the paged cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa_backend import (
    MSA_BACKENDS,
    MsaBackend,
)
from tensorrt_llm._torch.training.backend import TrainingAttentionBackend
from tensorrt_llm._torch.training.msa_dense import msa_dense_attention


class ChainBackend(TrainingAttentionBackend):
    """The training backend of the chain: ``step`` says which chain step the module runs."""

    name = "TRAINING_CHAIN"

    def __init__(self, msa_sparse: bool = True, train_indexer: bool = False) -> None:
        super().__init__(msa_sparse, train_indexer)
        self.step = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []


class ChainMsaBackend(MsaBackend):
    attn_backend: ChainBackend

    def attend(self, layer_idx, q, k, v, msa, metadata, cfg, scale):
        backend = self.attn_backend
        if backend.step == 0:
            backend.keys, backend.values = [k], [v]
            out, loss = msa_dense_attention(
                q, k, v, msa, cfg, scale, backend.msa_sparse, backend.train_indexer
            )
            if loss is not None:
                backend.indexer_losses[layer_idx] = loss
            return out
        backend.keys.append(k)
        backend.values.append(v)
        length = q.shape[1]
        pos = torch.arange(length, device=q.device)
        eye = torch.eye(length, dtype=torch.bool, device=q.device)
        mask = torch.cat([pos[None, :] <= pos[:, None]] + [eye] * backend.step, dim=1)
        groups = q.shape[2] // k.shape[2]
        keys = torch.cat(backend.keys, dim=1).transpose(1, 2).repeat_interleave(groups, dim=1)
        values = torch.cat(backend.values, dim=1).transpose(1, 2).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale
        )
        return out.transpose(1, 2)


MSA_BACKENDS[ChainBackend.name] = ChainMsaBackend


def mtp_ttt_logits(
    model, hidden: torch.Tensor, input_ids: torch.Tensor, num_steps: int, backend: ChainBackend
) -> list[torch.Tensor]:
    """``model``: a MiniMax-M3 model with its MTP module whose ``attn_backend`` is ``backend``;
    ``hidden [B, T, H]``: the target's hidden states after its final norm. Returns every step's
    logits ``[B, T, V]`` (float32); step ``i`` at row ``s`` predicts token ``s + i + 2`` (rows
    whose targets wrap past the end are the caller's to mask)."""
    batch, length = input_ids.shape
    pos = torch.arange(length, device=input_ids.device)
    outputs = []
    for i in range(num_steps):
        backend.step = i
        ids = torch.roll(input_ids, -(i + 1), dims=1)  # token s + i + 1 at row s
        positions = (pos + i).expand(batch, length)
        hidden = model.mtp_hidden(ids, hidden, positions)
        outputs.append(model.mtp_logits(hidden))
    return outputs
