"""MTP training-time test parity: step i of the training chain (``mtp_ttt_logits``) equals the
one-model worker's chained drafting with the MTP module through the paged cache (its layer in the
target's slots) at the same positions."""

import pytest
import torch
from m3_helpers import executor_config, tiny_config

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.models.checkpoint import random_model
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType
from tensorrt_llm._torch.speculative.interface import MTPSpecConfig
from tensorrt_llm._torch.speculative.mtp import MTPDrafter
from tensorrt_llm._torch.training import use_training_backend
from tensorrt_llm._torch.training.mtp_ttt import ChainBackend, mtp_ttt_logits

STEPS = 4  # max_draft_len + 1


@pytest.mark.parametrize("start", [0, 9, 30])
def test_training_steps_equal_chained_drafting(start):
    # (every index block kept: chain steps attend densely in training)
    cfg = tiny_config(num_mtp_modules=1, index_topk_blocks=8)
    model = random_model(cfg, seed=0, std=0.1, num_mtp_modules=1)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(start))
    with torch.no_grad():
        with use_training_backend(model):
            hidden, _ = model(ids)
        saved, model.attn_backend = model.attn_backend, ChainBackend()
        try:
            train = mtp_ttt_logits(model, hidden, ids, STEPS, model.attn_backend)
        finally:
            model.attn_backend = saved

        drafter = MTPDrafter(model)
        runtime = executor_config(
            max_tokens=256, max_seq_len=64, max_batch_size=1, spec=MTPSpecConfig(3)
        )
        managers = create_kv_cache_managers(cfg, runtime, drafter.kv_cache_layer())
        manager = managers[ResourceManagerType.KV_CACHE_MANAGER]
        manager.add_sequence(0, ids[0].tolist())
        assert manager.resize_sequence(0, start + STEPS)
        md = AttentionMetadata(manager, [0], [start + 1], [0], num_contexts=1)
        h, logits = drafter(ids[0, 1 : start + 2], hidden[0, : start + 1], md.position_ids, md)
        torch.testing.assert_close(logits[start], train[0][0, start], rtol=1e-4, atol=1e-4)
        h = h[start : start + 1]
        for i in range(1, STEPS):
            md = AttentionMetadata(manager, [0], [1], [start + i], num_contexts=0)
            h, logits = drafter(ids[0, start + i + 1 : start + i + 2], h, md.position_ids, md)
            torch.testing.assert_close(logits[0], train[i][0, start], rtol=1e-4, atol=1e-4)
