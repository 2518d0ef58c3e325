"""The draft sub-page view on a real MiniMax-M3 manager: arithmetic, preconditions, and an oracle
that reads the drafter's bytes back from the raw slot layout (not through the view)."""

import logging

import pytest
import torch

from tensorrt_llm._torch.attention_backend.interface import (
    PAGED_KV_CACHE_MEMBERS,
    AttentionMetadata,
)
from tensorrt_llm._torch.attention_backend.reference import paged_attention
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (
    MiniMaxM3KVCacheManagerV2,
    derive_shared_draft_layout,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.draft_subpage_view import (
    MiniMaxM3DraftSubpageView,
)
from tensorrt_llm._torch.pyexecutor.config import (
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm.runtime.kv_cache_manager_v2 import AttentionLayerConfig

DRAFT = 2  # layers 0 (dense) and 1 (sparse), then the draft layer
# Hand layout (tokens_per_block 128, head_dim 8, fp16, alignment 256, 32-token kernel pages):
#   L0 K@0 V@4096 | L1 K@8192 V@12288 | L1 index-K@16384 (2048 B) | draft K@18432 V@26624 (8192 B each)
#   end 34816 = 17 draft pages of 2048 B  ->  slot_bytes 34816, slot_units 17, subdiv 4
SLOT, DRAFT_K, DRAFT_KV_BYTES, UNITS = 34816, 18432, 8192, 17


def hand_config(num_slots=16, heads=(2, 2, 4), index_layers=(1,), **kw) -> KVCacheManagerV2Config:
    """Target layers of ``heads[:-1]`` KV heads (index-K of dim 8 on ``index_layers``), then a
    draft layer of ``heads[-1]``; head_dim 8, fp16, 128-token blocks, max_draft_len 3."""
    layers = tuple(
        KvCacheLayer(
            h, 8, index_head_dim=8 if i in index_layers else 0, is_draft=i == len(heads) - 1
        )
        for i, h in enumerate(heads)
    )
    return KVCacheManagerV2Config(
        layers=layers,
        max_seq_len=1024,
        max_batch_size=4,
        options=KvCacheOptions(128, "float16", max_tokens=128 * num_slots),
        max_draft_len=3,
        **kw,
    )


def m3_manager(**kw):
    return MiniMaxM3KVCacheManagerV2(hand_config(**kw))


def test_layout_and_view_geometry_match_the_hand_computation():
    mgr = m3_manager()
    assert mgr.slot_bytes() == SLOT
    assert mgr.kv_cache_pool_mapping.tolist() == [[0, 0], [0, 8192], [0, DRAFT_K]]
    assert mgr.sparse_layer_ids == (1,) and mgr.local_draft_layer_ids == (DRAFT,)
    view = mgr.draft_subpage_view
    assert (view.subdiv, view.slot_units, view.tokens_per_block, view.page_bytes) == (
        4,
        UNITS,
        32,
        2048,
    )
    assert view.max_blocks_per_seq == mgr.max_blocks_per_seq * 4
    assert view.blocks_in_primary_pool == (16 * SLOT - DRAFT_K) // 2048  # its own page units
    assert view.kv_cache_pool_pointers.tolist() == [[mgr.pools[0].data_ptr() + DRAFT_K, 0]]
    assert view.tokens_per_block != mgr.tokens_per_block


def test_the_view_declares_the_paged_kv_contract_and_nothing_of_the_manager():
    view = m3_manager().draft_subpage_view
    for name in PAGED_KV_CACHE_MEMBERS:
        getattr(view, name)  # every member the attention side reads is the view's own
    for name in ("kv_cache_pool_mapping", "host_kv_cache_block_offsets", "get_cache", "slot_bytes"):
        with pytest.raises(AttributeError):
            getattr(view, name)  # the manager's 128-token data is not reachable through the view
    assert not hasattr(type(view), "__getattr__")


def test_expansion_of_chosen_slots_and_slot_zero_padding():
    # entries past a row's slots expand to slot 0's sub-pages; that no kernel reads them is
    # test_reads_stay_in_rows.py's (slot 0 poisoned)
    mgr = m3_manager()
    mgr.impl._pool._free.rotate(-5)  # the next allocation starts at slot 5
    mgr.add_sequence(7, list(range(300)))
    assert mgr.resize_sequence(7, 300)
    slots = mgr.get_batch_cache_indices([7])[0]
    assert slots == [5, 6, 7]
    view = mgr.draft_subpage_view
    dst = torch.full((1, 2, 2, view.max_blocks_per_seq), -1, dtype=torch.int32)
    view.copy_batch_block_offsets(dst, [7], 1, 1, 1)
    k, v = dst[0, 0, 0].tolist(), dst[0, 0, 1].tolist()
    assert k[:12] == [s * UNITS + j for s in slots for j in range(4)]
    assert v[:12] == [s * UNITS + 4 + j for s in slots for j in range(4)]
    assert k[12:] == [0, 1, 2, 3] * (
        len(k[12:]) // 4
    )  # unallocated entries clamp to slot 0's pages
    assert v[12:] == [4, 5, 6, 7] * (len(v[12:]) // 4)
    assert dst[0, 1].eq(-1).all()


def test_subdiv_one_is_the_identity_expansion_under_the_env_override(monkeypatch):
    monkeypatch.setenv("TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK", "128")
    mgr = m3_manager()
    view = mgr.draft_subpage_view
    assert view.subdiv == 1 and view.tokens_per_block == 128
    assert mgr.slot_bytes() % DRAFT_KV_BYTES == 0  # the layout pads slots to whole draft blocks
    units = mgr.slot_bytes() // DRAFT_KV_BYTES
    mgr.add_sequence(0, list(range(200)))
    mgr.resize_sequence(0, 200)
    slots = mgr.get_batch_cache_indices([0])[0]
    dst = torch.zeros(1, 1, 2, view.max_blocks_per_seq, dtype=torch.int32)
    view.copy_batch_block_offsets(dst, [0])
    assert dst[0, 0, 0, :2].tolist() == [s * units for s in slots]
    assert dst[0, 0, 1, :2].tolist() == [s * units + 1 for s in slots]
    assert view.max_blocks_per_seq == mgr.max_blocks_per_seq


@pytest.mark.parametrize("value", ["48", "0", "256", "12"])
def test_an_invalid_override_fails_at_startup(monkeypatch, value):
    monkeypatch.setenv("TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK", value)
    with pytest.raises(ValueError, match=f"TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK={value}"):
        m3_manager()


def test_a_multi_pool_cache_is_refused_with_a_clear_error():
    class TwoLifeCycles(KVCacheManagerV2):
        def _layer_config(self, layer_id):
            cycle = "draft" if self.is_draft_layer(layer_id) else "target"
            return AttentionLayerConfig.kv(
                layer_id,
                2,
                8,
                self.dtype,
                life_cycle=cycle,
                depends_on_next_token=self.is_draft_layer(layer_id),
            )

    mgr = TwoLifeCycles(hand_config(num_slots=8, heads=(2, 2, 2), index_layers=()))
    assert mgr.num_pools == 2
    with pytest.raises(ValueError, match="single-pool KV cache; this one has 2 pools"):
        MiniMaxM3DraftSubpageView(mgr.host_block_table, mgr.layout, mgr.pools, [2], 128, 32)


def test_drafter_writes_through_the_view_land_in_the_raw_slot_layout_and_nothing_else_changes():
    mgr = m3_manager()
    mgr.impl._pool._free.rotate(-3)
    mgr.add_sequence(0, list(range(230)))
    mgr.resize_sequence(0, 230)
    slots = mgr.get_batch_cache_indices([0])[0]
    pool = mgr.pools[0]
    pool.view(torch.float16).normal_()  # target K/V and index-K bytes that must survive
    before = pool.clone()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(230, h, 8, generator=g).half() for h in (8, 4, 4))
    md = AttentionMetadata(mgr, [0], [230], [0], num_contexts=1)
    with md.swap_kv_cache_manager(mgr.draft_subpage_view):
        assert md.tokens_per_block == 32
        paged_attention(DRAFT, q, k, v, md, 1 / 8**0.5)
    assert md.kv_cache_manager is mgr and md.tokens_per_block == 128  # restored
    # Oracle: position p of the draft K/V lives at slot_bytes * slot + offset + (p % 128) * 64 bytes.
    flat = pool.view(-1)
    changed = torch.zeros_like(flat, dtype=torch.bool)
    for p in range(230):
        slot = slots[p // 128]
        for base, values in ((DRAFT_K, k), (DRAFT_K + DRAFT_KV_BYTES, v)):
            at = slot * SLOT + base + (p % 128) * 4 * 8 * 2
            assert torch.equal(flat[at : at + 64], values[p].reshape(-1).view(torch.uint8)), p
            changed[at : at + 64] = True
    assert torch.equal(flat[~changed], before.view(-1)[~changed])  # target bytes untouched


def test_derive_shared_draft_layout_under_both_creation_conventions():
    heads = [2] * 60 + [4]
    for num_layers in (60, 61):  # the target count, or already draft-extended
        layout = derive_shared_draft_layout(num_layers, heads, 1)
        assert layout.num_target_layers == 60 and layout.draft_layer_ids == (60,)
    with pytest.raises(ValueError, match="num_layers=59"):
        derive_shared_draft_layout(59, heads, 1)
    mgr = m3_manager()
    assert mgr.pp_layers == [0, 1, 2] and mgr.local_draft_layer_ids == (2,)
    assert (
        mgr.sparse_layer_ids == (1,)
        and mgr.layout.has(1, "index_key")
        and not mgr.layout.has(2, "index_key")
    )
    with pytest.raises(ValueError, match=r"draft layers \[2\]: a draft layer with an index-K"):
        m3_manager(index_layers=(1, 2))  # (only an MTP layer, of the target's geometry, is)


def test_the_property_is_lazy_cached_and_none_for_a_draft_manager(caplog):
    with caplog.at_level(logging.INFO, logger="tensorrt_llm"):
        mgr = m3_manager()
        assert mgr._draft_subpage_view is None
        view = mgr.draft_subpage_view
        assert view is mgr.draft_subpage_view
    messages = [r.getMessage() for r in caplog.records if "[unified-kv]" in r.getMessage()]
    assert any("share the target KV cache manager (sparse layers [1])" in m for m in messages)
    assert any(
        "draft subpage view active: draft_layers=[2] subdiv=4 tokens_per_block=32" in m
        for m in messages
    )
    draft_only = m3_manager(num_slots=8, local_layer_ids=(2,), is_draft=True)
    assert draft_only.draft_subpage_view is None
