"""The executor-facing KVCacheManagerV2: views, tables, the step protocol, exhaustion, reuse."""

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.config import (
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.pyexecutor.resource_manager import (
    ResourceManager,
    ResourceManagerType,
    get_pp_layers,
)
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig

TPB = 4
EAGLE = Eagle3SpecConfig(max_draft_len=3, speculative_model="unused")


def make(max_tokens=64, draft=False, heads=(2, 2), reuse=True, max_batch_size=4, max_seq_len=32):
    """Two target layers (head_dim 8, fp16), then a draft layer when ``draft`` (max_draft_len 3);
    ``heads`` gives each layer's KV heads."""
    layers = tuple(KvCacheLayer(h, 8, is_draft=i >= 2) for i, h in enumerate(heads))
    return KVCacheManagerV2(
        KVCacheManagerV2Config(
            layers=layers,
            max_seq_len=max_seq_len,
            max_batch_size=max_batch_size,
            options=KvCacheOptions(TPB, "float16", max_tokens, enable_block_reuse=reuse),
            max_draft_len=3 if draft else 0,
        )
    )


def context_request(request_id, prompt, chunk=None):
    return LlmRequest(
        request_id, list(prompt), max_new_tokens=8, context_chunk_size=chunk or len(prompt)
    )


def run_context(mgr, *requests):
    """One context step: reserve, 'compute', then record what became final."""
    batch = ScheduledRequests(context_requests=list(requests))
    mgr.prepare_resources(batch)
    for req in batch.context_requests:
        if req.request_id in batch.reused_tokens:
            req.skip_reused_prefix(batch.reused_tokens[req.request_id])
        req.context_current_position += req.context_chunk_size
        if req.context_current_position == req.prompt_len:
            req.output_token_ids.append(1000 + req.request_id)
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
    mgr.update_resources(batch)
    mgr.check_integrity()
    return batch


def test_get_pp_layers_appends_one_model_draft_layers():
    assert get_pp_layers(3) == ([0, 1, 2], 3)
    assert get_pp_layers(3, spec_config=EAGLE) == ([0, 1, 2, 3], 4)
    assert get_pp_layers(3, spec_config=EAGLE, layer_mask=[True, False, True, True]) == (
        [0, 2, 3],
        4,
    )


def test_draft_layer_with_its_own_geometry_is_a_zero_copy_view_at_the_documented_offset():
    mgr = make(draft=True, heads=[2, 2, 4])
    assert mgr.pp_layers == [0, 1, 2] and mgr.is_draft_layer(2) and not mgr.is_draft_layer(1)
    # alignment 256: L0 K@0 V@128, L1 K@256 V@384, draft K@512 (4 heads: 256 B) V@768; slot 1024
    assert mgr.slot_bytes() == 1024
    assert mgr.kv_cache_pool_mapping.tolist() == [[0, 0], [0, 256], [0, 512]]
    pool = mgr.pools[0]
    assert mgr.kv_cache_pool_pointers.tolist() == [[pool.data_ptr(), 0]]
    draft = mgr.get_buffers(2)
    assert draft.shape == (mgr.blocks_in_primary_pool, 2, TPB, 4, 8)
    assert draft.data_ptr() == pool.data_ptr() + 512
    draft[3, 1, 2, 3, 7] = 5.0  # slot 3, V, token 2, head 3, dim 7
    at = 3 * 1024 + 768 + ((2 * 4 + 3) * 8 + 7) * 2
    assert pool.view(-1)[at : at + 2].view(torch.float16).item() == 5.0
    assert int((pool != 0).sum()) == 1  # 5.0 in fp16 is 0x4500: one non-zero byte
    assert mgr.get_buffers(0).shape == (mgr.blocks_in_primary_pool, 2, TPB, 2, 8)
    with pytest.raises(ValueError, match="kv_layout='HND'"):
        mgr.get_buffers(0, kv_layout="HND")


def test_sizes_and_limits():
    mgr = make(max_tokens=30)
    assert mgr.blocks_in_primary_pool == 8  # ceil(30 / 4)
    assert mgr.max_blocks_per_seq == 8  # ceil(32 / 4)
    assert make(draft=True, heads=[2, 2, 2]).max_blocks_per_seq == 10  # + 2 * max_draft_len
    assert mgr.get_max_resource_count() == 8
    with pytest.raises(ValueError, match="draft layers must follow every target layer"):
        KVCacheManagerV2Config(
            layers=(KvCacheLayer(2, 8, is_draft=True), KvCacheLayer(2, 8)),
            max_seq_len=32,
            max_batch_size=1,
        )
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        mgr.add_sequence(0, list(range(33)))


def test_context_then_generation_with_drafts_commits_only_final_tokens_and_rewinds():
    mgr = make()
    req = context_request(7, range(10))
    run_context(mgr, req)
    cache = mgr.get_cache(7)
    # reservations run to the end of the last block they need (10 positions: 3 blocks of 4)
    assert (cache.capacity, cache.num_committed_tokens, cache.num_committed_blocks) == (12, 10, 2)
    assert mgr.get_batch_cache_indices([7]) == [[0, 1, 2]]

    req.py_draft_tokens = [5, 6, 7]  # verify [last token + 3 drafts] at positions 10..13
    batch = ScheduledRequests(generation_requests=[req])
    mgr.prepare_resources(batch)
    mgr.check_integrity()
    assert cache.capacity == 16 and mgr.get_batch_cache_indices([7]) == [[0, 1, 2, 3]]
    req.output_token_ids += [5, 9]  # one draft accepted, plus the bonus token
    req.py_draft_tokens = []
    mgr.update_resources(batch)
    mgr.check_integrity()
    # the newest token's KV comes next step; the rejected drafts' block is given back
    assert (cache.num_committed_tokens, cache.capacity) == (12, 12)
    assert mgr.get_batch_cache_indices([7]) == [[0, 1, 2]]
    assert cache.committed_tokens == tuple(range(10)) + (1007, 5)
    mgr.free_resources(req)
    mgr.check_integrity()
    stats = mgr.get_kv_cache_stats()
    assert (stats.num_used_slots, stats.num_cached_slots) == (0, 3)


def test_copy_batch_block_offsets_gathers_rows_in_batch_order():
    mgr = make()
    reqs = [context_request(i, range(100 * i, 100 * i + 3 + 4 * i)) for i in range(3)]
    run_context(mgr, *reqs)
    dst = torch.full((1, 4, 2, mgr.max_blocks_per_seq), -1, dtype=torch.int32)
    order = [2, 0, 1]
    mgr.copy_batch_block_offsets(dst, order, 1, 0, 3)
    for row, rid in enumerate(order):
        blocks = mgr.get_batch_cache_indices([rid])[0]
        for lane in (0, 1):
            assert dst[0, row, lane, : len(blocks)].tolist() == blocks
            assert dst[0, row, lane, len(blocks) :].eq(0).all()
    assert dst[0, 3].eq(-1).all()  # rows past num_seqs untouched


def test_a_request_that_does_not_fit_is_paused_and_holds_nothing():
    mgr = make(max_tokens=16)  # 4 slots
    a, b, c = (context_request(i, range(10 * i, 10 * i + 8)) for i in range(3))
    batch = run_context(mgr, a, b, c)
    assert [r.request_id for r in batch.context_requests] == [0, 1]
    assert [r.request_id for r in batch.paused_requests] == [2]
    assert c.context_current_position == 0
    stats = mgr.get_kv_cache_stats()
    assert (stats.num_used_slots, stats.num_free_slots) == (4, 0)
    with pytest.raises(KeyError):
        mgr.get_cache(2)
    mgr.free_resources(a)
    batch = run_context(mgr, c)
    assert batch.paused_requests == [] and c.context_current_position == 8


def test_reused_prefix_skips_prefill_of_its_tokens():
    mgr = make()
    first = context_request(0, range(11))
    run_context(mgr, first)
    mgr.free_resources(first)
    again = context_request(1, list(range(11)) + [42, 43])
    batch = ScheduledRequests(context_requests=[again])
    mgr.prepare_resources(batch)
    assert batch.reused_tokens == {1: 8}  # reported; the scheduler's choice is left as it was
    assert (again.context_current_position, again.context_chunk_size) == (0, 13)
    again.skip_reused_prefix(batch.reused_tokens[1])
    assert again.num_reused_tokens == 8
    assert (again.context_current_position, again.context_chunk_size) == (8, 5)
    assert mgr.get_batch_cache_indices([1])[0][:2] == [0, 1]
    assert mgr.get_kv_cache_stats().num_reused_blocks == 2


def test_draft_kv_of_a_block_is_not_reused_when_the_next_token_differs():
    mgr = make(draft=True, heads=[2, 2, 4])
    shared = [11, 12, 13, 14]
    first = context_request(0, shared + [1, 2])
    run_context(mgr, first)
    slot_a = mgr.get_batch_cache_indices([0])[0][0]
    mgr.get_buffers(2)[slot_a].fill_(3.0)  # the drafter's KV for block 0, computed with successor 1
    mgr.free_resources(first)
    second = context_request(1, shared + [9, 2])
    batch = ScheduledRequests(context_requests=[second])
    mgr.prepare_resources(batch)
    mgr.check_integrity()
    assert batch.reused_tokens == {}
    slot_b = mgr.get_batch_cache_indices([1])[0][0]
    assert slot_b != slot_a
    assert not mgr.get_buffers(2)[slot_b].eq(3.0).any()
    third = context_request(2, shared + [1, 7])
    batch = ScheduledRequests(context_requests=[third])
    mgr.prepare_resources(batch)
    assert batch.reused_tokens == {2: 4} and mgr.get_batch_cache_indices([2])[0][0] == slot_a


def test_resource_manager_registry_drives_every_manager():
    mgr = make()
    registry = ResourceManager({ResourceManagerType.KV_CACHE_MANAGER: mgr})
    assert registry.get_resource_manager(ResourceManagerType.KV_CACHE_MANAGER) is mgr
    assert registry.get_resource_manager(ResourceManagerType.DRAFT_KV_CACHE_MANAGER) is None
    req = context_request(0, range(5))
    batch = ScheduledRequests(context_requests=[req])
    registry.prepare_resources(batch)
    assert mgr.get_cache(0).capacity >= 5 and mgr.get_cache(0).num_blocks == 2  # 4-token blocks
    registry.free_resources(req)
    registry.shutdown()
    assert mgr.get_kv_cache_stats().num_used_slots == 0


def test_a_separate_draft_manager_reserves_past_the_targets_reused_prefix():
    target = make()
    layers = (KvCacheLayer(2, 8), KvCacheLayer(2, 8), KvCacheLayer(4, 8, is_draft=True))
    draft = KVCacheManagerV2(
        KVCacheManagerV2Config(
            layers=layers,
            max_seq_len=32,
            max_batch_size=4,
            options=KvCacheOptions(TPB, "float16", 64, enable_block_reuse=False),
            local_layer_ids=(2,),
            is_draft=True,
        )
    )
    registry = ResourceManager(  # the draft manager registered first: the order must not matter
        {
            ResourceManagerType.DRAFT_KV_CACHE_MANAGER: draft,
            ResourceManagerType.KV_CACHE_MANAGER: target,
        }
    )
    first = context_request(0, range(11))
    batch = ScheduledRequests(context_requests=[first])
    registry.prepare_resources(batch)
    first.context_current_position = 11
    registry.update_resources(batch)
    registry.free_resources(first)
    again = context_request(1, list(range(11)) + [42, 43], chunk=3)  # a 3-token first chunk
    batch = ScheduledRequests(context_requests=[again])
    registry.prepare_resources(batch)
    assert batch.reused_tokens == {1: 8}  # the target's report; the draft manager reuses nothing
    # both cover the chunk after the reused prefix: positions [8, 11)
    for manager in (target, draft):  # to the end of the third 4-token block
        assert manager.get_cache(1).capacity == 12 and manager.get_cache(1).num_blocks == 3
    target.check_integrity()
    draft.check_integrity()
