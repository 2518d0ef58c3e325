"""Training-time test parity: step i of the training forward equals real chained drafting through
the paged cache at the same positions."""

import pytest
import torch
from m3_helpers import executor_config, tiny_config

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.models.checkpoint import random_eagle3, random_model
from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig
from tensorrt_llm._torch.training import ttt_logits, use_training_backend

STEPS = 4  # max_draft_len + 1


@pytest.mark.parametrize("start", [0, 9, 30])
def test_training_steps_equal_chained_drafting(start):
    cfg = tiny_config()
    target = random_model(cfg, seed=0, std=0.1)
    draft_cfg = Eagle3Config.from_dict(
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            vocab_size=64,
            draft_vocab_size=64,
            target_hidden_size=32,
        )
    )
    draft = random_eagle3(draft_cfg, layer_idx=3, seed=1, std=0.1)
    draft.embed_tokens = target.model.embed_tokens
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(start))
    with torch.no_grad():
        with use_training_backend(target):
            _, captured = target(ids, capture_layers=(0, 1, 2))
        train = ttt_logits(draft, captured, ids, STEPS)

        # the drafter's own manager (separate mode), so its KV is addressed like any layer's
        spec = Eagle3SpecConfig(3, "unused", draft_kv_cache="separate")
        runtime = executor_config(max_tokens=256, max_seq_len=64, max_batch_size=1, spec=spec)
        managers = create_kv_cache_managers(cfg, runtime, draft_geometry=(4, 8))
        manager = managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER]
        manager.add_sequence(0, ids[0].tolist())
        assert manager.resize_sequence(0, start + STEPS)
        md = AttentionMetadata(manager, [0], [start + 1], [0], num_contexts=1)
        features = draft.fuse([c[0, : start + 1] for c in captured])
        hidden, logits = draft(ids[0, 1 : start + 2], features, md.position_ids, md)
        torch.testing.assert_close(logits[start], train[0][0, start], rtol=1e-4, atol=1e-4)
        hidden = hidden[start : start + 1]
        for i in range(1, STEPS):
            md = AttentionMetadata(manager, [0], [1], [start + i], num_contexts=0)
            hidden, logits = draft(
                ids[0, start + i + 1 : start + i + 2], hidden, md.position_ids, md
            )
            torch.testing.assert_close(logits[0], train[i][0, start], rtol=1e-4, atol=1e-4)
