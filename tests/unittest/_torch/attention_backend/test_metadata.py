"""The step metadata: tensors in persistent buffers, and advancing a draft chain in place."""

import pytest
import torch
from m3_helpers import m3_manager, tiny_config

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, MetadataBuffers

FIELDS = ("position_ids", "token_seq_idx", "cu_seqlens_q", "kv_lens", "num_cached_tokens")


def manager_with(lengths):
    mgr = m3_manager(tiny_config())
    for rid, n in enumerate(lengths):
        mgr.add_sequence(rid, list(range(n)))
        assert mgr.resize_sequence(rid, n + 4)
    return mgr


def test_advance_equals_metadata_built_at_the_next_positions():
    mgr = manager_with([9, 17, 30])
    md = AttentionMetadata(mgr, [0, 1, 2], [1, 1, 1], [9, 17, 30], num_contexts=0)
    md.advance()
    md.advance()
    fresh = AttentionMetadata(mgr, [0, 1, 2], [1, 1, 1], [11, 19, 32], num_contexts=0)
    for name in (*FIELDS, "kv_lens_cpu", "position_ids_cpu", "kv_cache_block_offsets"):
        assert torch.equal(getattr(md, name), getattr(fresh, name)), name
    assert md.num_cached_tokens_per_seq == [11, 19, 32]


def test_advance_refuses_a_batch_that_is_not_one_token_per_sequence():
    mgr = manager_with([9, 17])
    md = AttentionMetadata(mgr, [0, 1], [3, 1], [6, 17], num_contexts=1)
    with pytest.raises(ValueError, match="one generation token per sequence"):
        md.advance()


def test_steps_reuse_the_same_device_buffers():
    mgr = manager_with([9, 17, 30])
    buffers = MetadataBuffers()
    first = AttentionMetadata(mgr, [0, 1, 2], [2, 1, 1], [7, 17, 30], 1, buffers=buffers)
    ptrs = {name: getattr(first, name).data_ptr() for name in (*FIELDS, "kv_cache_block_offsets")}
    second = AttentionMetadata(mgr, [2, 0], [1, 1], [30, 9], 0, buffers=buffers)
    for name, ptr in ptrs.items():
        assert getattr(second, name).data_ptr() == ptr, name  # same storage, no new allocation
    expect = torch.zeros_like(second.kv_cache_block_offsets)
    mgr.copy_batch_block_offsets(expect, [2, 0])
    assert torch.equal(second.kv_cache_block_offsets, expect)  # rows fully rewritten


def test_a_draft_swap_keeps_the_targets_table_intact():
    mgr = manager_with([20, 30])
    md = AttentionMetadata(mgr, [0, 1], [1, 1], [20, 30], 0)
    target_table = md.kv_cache_block_offsets.clone()
    other = m3_manager(tiny_config(), tokens_per_block=8)
    other.add_sequence(0, list(range(5)))
    other.add_sequence(1, list(range(5)))
    with md.swap_kv_cache_manager(other):
        assert md.tokens_per_block == 8
    assert torch.equal(md.kv_cache_block_offsets, target_table)
