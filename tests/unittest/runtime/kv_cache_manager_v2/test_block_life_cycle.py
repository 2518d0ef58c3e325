"""Exact slot ids, reuse and eviction order on a tiny cache (4 tokens per block, 8 slots).

The free queue is FIFO: slots start as 0..7; a closed sequence returns its private slots tail first;
allocation takes from the front. Every test checks integrity after every step.
"""

import pytest

from tensorrt_llm.runtime.kv_cache_manager_v2 import AllocationStatus

T = list(range(100, 200))  # a token script; prompts are slices of it


def test_allocation_takes_slots_in_free_queue_order(manager):
    a = manager.create_kv_cache()
    assert a.resize(9).status is AllocationStatus.OK
    manager.check_integrity()
    assert a.block_table == (0, 1, 2)
    b = manager.create_kv_cache()
    b.resize(4)
    manager.check_integrity()
    assert b.block_table == (3,)
    a.close()
    manager.check_integrity()
    assert manager.free_slots == (4, 5, 6, 7, 2, 1, 0)
    c = manager.create_kv_cache()
    c.resize(8)
    manager.check_integrity()
    assert c.block_table == (4, 5)


def test_only_full_blocks_of_committed_tokens_enter_the_tree(manager):
    a = manager.create_kv_cache(T[:10])
    assert a.num_reused_tokens == 0
    a.resize(10)
    a.commit(T[:6])
    manager.check_integrity()
    assert (a.num_committed_tokens, a.num_committed_blocks, a.history_length) == (6, 1, 6)
    assert not a.is_writable(0) and a.is_writable(1) and a.is_writable(2)
    a.commit(T[6:10])
    manager.check_integrity()
    assert a.num_committed_blocks == 2
    assert manager.stats().num_used_slots == 3


def test_second_sequence_reuses_the_committed_prefix(manager):
    a = manager.create_kv_cache(T[:9])
    a.resize(9)
    a.commit(T[:9])
    a.close()
    manager.check_integrity()
    assert manager.free_slots == (3, 4, 5, 6, 7, 2)
    assert manager.stats().num_cached_slots == 2

    b = manager.create_kv_cache(T[:12])
    manager.check_integrity()
    assert b.block_table == (0, 1)
    assert (b.num_reused_tokens, b.history_length, b.capacity) == (8, 8, 8)
    assert b.committed_tokens == tuple(T[:8])
    assert b.resize(12).ok
    manager.check_integrity()
    assert b.block_table == (0, 1, 3)
    stats = manager.stats()
    assert (stats.num_reused_blocks, stats.num_lookup_blocks, stats.num_cached_slots) == (
        2,
        2 + 2,
        0,
    )


def test_reuse_leaves_at_least_one_prompt_token_to_compute(manager):
    a = manager.create_kv_cache(T[:8])
    a.resize(8)
    a.commit(T[:8])
    a.close()
    b = manager.create_kv_cache(
        T[:8]
    )  # both blocks are committed, but the last token must be recomputed
    manager.check_integrity()
    assert b.num_reused_tokens == 4
    assert b.block_table == (0,)


def test_eviction_takes_least_recently_released_leaves_first(manager):
    a = manager.create_kv_cache(T[:8])
    a.resize(8)
    a.commit(T[:8])
    assert a.block_table == (0, 1)
    a.close()  # releases slot 1 then slot 0
    b = manager.create_kv_cache(T[50:58])
    b.resize(8)
    b.commit(T[50:58])
    assert b.block_table == (2, 3)
    b.close()
    manager.check_integrity()
    assert manager.free_slots == (4, 5, 6, 7)

    c = manager.create_kv_cache()
    result = c.resize(24)  # six slots: four free, then A's leaf (1), then A's root block (0)
    manager.check_integrity()
    assert result.status is AllocationStatus.OK_AFTER_EVICTION and result.num_evicted == 2
    assert c.block_table == (4, 5, 6, 7, 1, 0)
    assert manager.probe_reuse(T[:9]) == 0
    assert manager.probe_reuse(T[50:59]) == 8


def test_reusing_a_prefix_makes_it_recent(manager):
    for start in (0, 50):
        s = manager.create_kv_cache(T[start : start + 8])
        s.resize(8)
        s.commit(T[start : start + 8])
        s.close()
    toucher = manager.create_kv_cache(T[:5])  # reuses A's first block (slot 0), then lets go
    assert toucher.block_table == (0,)
    toucher.close()
    manager.check_integrity()
    assert manager.evict(2) == 2  # A's leaf (slot 1) is oldest; then B's leaf (slot 3)
    manager.check_integrity()
    assert manager.free_slots[-2:] == (1, 3)
    assert manager.probe_reuse(T[:9]) == 4
    assert manager.probe_reuse(T[50:59]) == 4


def test_held_blocks_are_never_evicted_and_a_short_pool_changes_nothing(manager):
    a = manager.create_kv_cache(T[:8])
    a.resize(8)
    a.commit(T[:8])
    a.close()
    b = manager.create_kv_cache(T[:5])  # holds slot 0 (A's first block); slot 1 stays cached
    assert b.block_table == (0,)
    before = (b.block_table, b.capacity, manager.free_slots, manager.stats())
    result = b.resize(4 * 9)  # eight more blocks; only 6 free + 1 cached exist
    manager.check_integrity()
    assert result.status is AllocationStatus.CANNOT_ALLOCATE and not result
    assert result.num_missing == 1
    assert (b.block_table, b.capacity, manager.free_slots, manager.stats()) == before
    assert b.resize(4 * 8).status is AllocationStatus.OK_AFTER_EVICTION
    manager.check_integrity()
    assert b.block_table == (0, 2, 3, 4, 5, 6, 7, 1)


def test_rewind_frees_tail_blocks_but_never_goes_below_history(manager):
    a = manager.create_kv_cache()
    a.resize(12)
    a.commit(T[:5])
    a.resize(6)
    manager.check_integrity()
    assert a.block_table == (0, 1) and a.capacity == 6
    assert manager.free_slots == (3, 4, 5, 6, 7, 2)
    with pytest.raises(ValueError, match="below history_length=5"):
        a.resize(4)
    with pytest.raises(ValueError, match="would decrease"):
        a.resize(6, history_length=4)
    a.resize(6, history_length=6)
    assert a.history_length == 6
    manager.check_integrity()


def test_commit_past_capacity_is_an_error_that_changes_nothing(manager):
    a = manager.create_kv_cache()
    a.resize(4)
    with pytest.raises(ValueError, match="exceeds capacity=4"):
        a.commit(T[:5])
    assert a.num_committed_tokens == 0
    manager.check_integrity()


def test_capacity_beyond_max_blocks_per_seq_is_rejected(new_manager):
    m = new_manager(max_blocks_per_seq=2)
    a = m.create_kv_cache()
    with pytest.raises(ValueError, match="max_blocks_per_seq=2"):
        a.resize(9)
    assert a.num_blocks == 0
    m.check_integrity()


def test_same_block_committed_twice_shares_the_node_and_frees_the_copy(manager):
    a = manager.create_kv_cache(T[:6])
    b = manager.create_kv_cache(T[:6])  # nothing committed yet: both compute the same block
    a.resize(6)
    b.resize(6)
    assert (a.block_table, b.block_table) == ((0, 1), (2, 3))
    a.commit(T[:6])
    b.commit(T[:6])
    manager.check_integrity()
    assert manager.stats().num_used_slots == 4
    a.close()
    b.close()
    manager.check_integrity()
    stats = manager.stats()
    assert (stats.num_cached_slots, stats.num_free_slots) == (1, 7)
    c = manager.create_kv_cache(T[:6])
    assert c.block_table == (0,)


def test_reuse_scope_separates_chains(manager):
    a = manager.create_kv_cache(T[:8], reuse_scope="tenant-a")
    a.resize(8)
    a.commit(T[:8])
    a.close()
    assert manager.probe_reuse(T[:9], reuse_scope="tenant-b") == 0
    assert manager.probe_reuse(T[:9]) == 0
    assert manager.probe_reuse(T[:9], reuse_scope="tenant-a") == 8


def test_disabled_reuse_never_caches(new_manager):
    m = new_manager(enable_block_reuse=False)
    a = m.create_kv_cache(T[:8])
    a.resize(8)
    a.commit(T[:8])
    a.close()
    m.check_integrity()
    assert m.stats().num_cached_slots == 0 and m.num_free_slots == 8
    assert m.create_kv_cache(T[:9]).num_reused_tokens == 0


def test_closed_cache_refuses_further_use(manager):
    a = manager.create_kv_cache()
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.resize(4)


# ---- the drafter boundary rule ---------------------------------------------------------------


def test_draft_layout_does_not_reuse_a_block_whose_successor_differs(new_manager):
    m = new_manager(draft=True)
    first = T[:4] + [1, 2, 3, 4, 5]
    a = m.create_kv_cache(first)
    a.resize(9)
    a.commit(first)
    m.check_integrity()
    assert a.num_committed_blocks == 2  # block 1's successor (token 8) is committed too
    a.close()
    # Shares block 0's tokens, differs in the token right after it: block 0's draft KV is not valid.
    second = T[:4] + [9, 2, 3, 4, 5]
    b = m.create_kv_cache(second)
    m.check_integrity()
    assert b.num_reused_tokens == 0 and b.block_table == ()
    b.resize(9)
    assert 0 not in b.block_table and 1 not in b.block_table
    # Same successor: reused.
    c = m.create_kv_cache(T[:4] + [1, 7, 7])
    assert c.num_reused_tokens == 4 and c.block_table == (0,)
    m.check_integrity()


def test_target_only_layout_reuses_regardless_of_successor(manager):
    a = manager.create_kv_cache(T[:4] + [1, 2])
    a.resize(6)
    a.commit(T[:4] + [1, 2])
    a.close()
    assert manager.create_kv_cache(T[:4] + [9, 2]).num_reused_tokens == 4


def test_draft_layout_commits_a_block_only_once_its_successor_is_committed(new_manager):
    m = new_manager(draft=True)
    a = m.create_kv_cache()
    a.resize(8)
    a.commit(T[:8])
    assert a.num_committed_blocks == 1
    a.resize(9)
    a.commit(T[8:9])
    assert a.num_committed_blocks == 2
    m.check_integrity()
