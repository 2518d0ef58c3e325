"""Eagle3 training-time test (TTT): every position starts a whole draft chain in one forward.

Training the drafter on its own chained outputs, as it runs at inference, instead of only on the
target's features (teacher forcing of step 0). ``tests/unittest/_torch/models/test_eagle3_ttt.py``
pins that step ``i`` here equals real chained drafting through the paged cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.models.modeling_speculative import Eagle3DraftModel
from tensorrt_llm._torch.modules.rotary_embedding import apply_partial_rope


def ttt_logits(
    draft: Eagle3DraftModel, captured: list[torch.Tensor], input_ids: torch.Tensor, num_steps: int
) -> list[torch.Tensor]:
    """Training-time test: every row ``s`` runs a whole draft chain started at position ``s``.

    Step ``i`` at row ``s`` is chain step ``i`` of a draft that starts after position ``s``: input
    token ``s + i + 1`` (teacher-forced: only drafts equal to it matter, the rest are rejected) at
    position ``s + i``, features from the target (step 0) or the drafter's own step ``i - 1`` at row
    ``s``. Its query sees step 0's keys at positions ``<= s`` and its own chain's keys (steps 1..i at
    row ``s``), exactly the keys a real chained draft finds in its KV cache. Returns the draft logits
    of every step, ``[B, T, draft_vocab]`` each; step ``i`` at row ``s`` predicts token ``s + i + 2``.
    """
    batch, length = input_ids.shape
    attn = draft.midlayer.self_attn
    layer = draft.midlayer
    pos = torch.arange(length, device=input_ids.device)
    hidden = draft.fuse(captured)
    keys, values, outputs = [], [], []
    for i in range(num_steps):
        ids = torch.roll(
            input_ids, -(i + 1), dims=1
        )  # token s+i+1 at row s (wrapped rows are masked by the caller)
        positions = (pos + i).expand(batch, length)
        embeds = draft.embed_tokens(ids).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        q = apply_partial_rope(
            attn.q_proj(x).unflatten(-1, (attn.num_heads, attn.head_dim)),
            positions,
            attn.head_dim,
            attn.rope_theta,
        )
        k = apply_partial_rope(
            attn.k_proj(x).unflatten(-1, (attn.num_kv_heads, attn.head_dim)),
            positions,
            attn.head_dim,
            attn.rope_theta,
        )
        keys.append(k)
        values.append(attn.v_proj(x).unflatten(-1, (attn.num_kv_heads, attn.head_dim)))
        # [T, (i + 1) T]: causal over step 0, the diagonal over each later step
        eye = torch.eye(length, dtype=torch.bool, device=input_ids.device)
        mask = torch.cat([pos[None, :] <= pos[:, None]] + [eye] * i, dim=1)
        groups = attn.num_heads // attn.num_kv_heads
        k_all = torch.cat(keys, dim=1).transpose(1, 2).repeat_interleave(groups, dim=1)
        v_all = torch.cat(values, dim=1).transpose(1, 2).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_all, v_all, attn_mask=mask, scale=attn.scale
        )
        hidden = hidden + attn.o_proj(out.transpose(1, 2).flatten(-2))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        outputs.append(draft.lm_head(draft.norm(hidden)).float())
    return outputs
