"""Random add / extend / commit / rewind / free / evict sequences over mixed layouts.

After every step: ``check_integrity()`` (every slot in exactly one state, reference counts, tree
shape), and every committed block of every live sequence holds exactly the bytes its token prefix
(and, for draft layouts, its successor) determines. Sequences scribble over their writable blocks at
random, so a slot wrongly handed out as private while shared would corrupt another sequence's
committed bytes and fail the check.
"""

import hashlib

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tensorrt_llm.runtime.kv_cache_manager_v2 import (
    AttentionLayerConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import allocate_pools

LAYOUTS = {
    "draft_three_size_classes": KVCacheManagerConfig(
        tokens_per_block=4,
        layers=(
            AttentionLayerConfig.kv(0, 2, 8, "float16"),
            AttentionLayerConfig.kv(1, 2, 8, "float16", index_key=(1, 8, "float16")),
            AttentionLayerConfig.kv(2, 4, 8, "float16", depends_on_next_token=True),
        ),
        num_slots=10,
        alignment_bytes=64,
        kernel_page_tokens=2,
    ),
    "two_life_cycles_mixed_dtypes": KVCacheManagerConfig(
        tokens_per_block=2,
        layers=(
            AttentionLayerConfig.kv(0, 1, 4, "float32", life_cycle="a"),
            AttentionLayerConfig.kv(1, 2, 4, "bfloat16", life_cycle="b"),
            AttentionLayerConfig.kv(
                2, 1, 4, "float32", life_cycle="a", index_key=(1, 2, "float32")
            ),
        ),
        num_slots=12,
        alignment_bytes=16,
    ),
    "target_only_small_pool": KVCacheManagerConfig(
        tokens_per_block=4,
        layers=(AttentionLayerConfig.kv(0, 2, 4, "float32"),),
        num_slots=6,
        alignment_bytes=32,
        kernel_page_tokens=4,
    ),
}


# Scripts fork from a few shared documents at a random point, so prefixes are shared often and
# diverge anywhere, including right after a block boundary (the drafter boundary rule's case).
DOCUMENTS = ([1, 2, 3, 1, 2, 3, 3, 2, 1, 1, 2, 2, 3, 3, 1, 2, 1, 3], [3] * 18, [2, 1] * 9)
scripts = st.builds(
    lambda doc, fork, tail: (DOCUMENTS[doc][:fork] + tail)[:18] or [1],
    st.integers(0, len(DOCUMENTS) - 1),
    st.integers(0, 18),
    st.lists(st.integers(1, 3), max_size=18),
)


def content(pool_index: int, slot_bytes: int, tokens: tuple[int, ...]) -> torch.Tensor:
    digest = hashlib.sha256(repr((pool_index, tokens)).encode()).digest()
    reps = -(-slot_bytes // len(digest))
    return torch.frombuffer(bytearray(digest * reps), dtype=torch.uint8)[:slot_bytes]


class CacheMachine(RuleBasedStateMachine):
    config: KVCacheManagerConfig

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(self.config)
        self.pools = allocate_pools(self.m.layout, self.m.num_slots, "cpu")
        self.scripts: dict[int, list[int]] = {}  # cache id -> the tokens it will commit, in order
        self.tpb = self.config.tokens_per_block

    def _pick(self, data):
        caches = self.m.live_caches
        return data.draw(st.sampled_from(caches)) if caches else None

    def _block_tokens(self, script: list[int], b: int) -> tuple[int, ...]:
        end = (b + 1) * self.tpb
        return tuple(script[: end + 1] if self.config.successor_aware else script[:end])

    def _write_block(self, slot: int, tokens: tuple[int, ...]) -> None:
        for i, pool in enumerate(self.pools):
            pool[slot] = content(i, pool.shape[1], tokens)

    @rule(
        script=scripts,
        prompt_len=st.integers(1, 18),
        scope=st.sampled_from([None, "salt"]),
        prefill=st.booleans(),
    )
    def add(self, script, prompt_len, scope, prefill):
        prompt = script[:prompt_len]
        cache = self.m.create_kv_cache(prompt, reuse_scope=scope)
        assert cache.num_reused_tokens % self.tpb == 0
        assert cache.num_reused_tokens <= max(0, len(prompt) - 1)
        assert cache.committed_tokens == tuple(script[: cache.num_reused_tokens])
        self.scripts[cache.id] = script
        if prefill and cache.resize(len(prompt)):  # a context step: the whole prompt becomes final
            self._commit(cache, len(prompt) - cache.num_committed_tokens)

    @rule(data=st.data(), n=st.integers(1, 9), scribble=st.integers(0, 255))
    def extend(self, data, n, scribble):
        cache = self._pick(data)
        if cache is None:
            return
        before = (cache.block_table, cache.capacity, self.m.free_slots)
        result = cache.resize(min(cache.capacity + n, 24))
        if not result:
            assert result.num_missing > 0
            assert (cache.block_table, cache.capacity, self.m.free_slots) == before
            return
        for b in range(cache.num_committed_blocks, cache.num_blocks):
            assert cache.is_writable(b)
            for pool in self.pools:
                pool[cache.block_table[b]] = scribble

    @rule(data=st.data(), n=st.integers(1, 9))
    def commit(self, data, n):
        cache = self._pick(data)
        if cache is not None:
            self._commit(cache, n)

    @rule(data=st.data(), n=st.integers(1, 4))
    def decode_step(self, data, n):
        """A generation step: room for n new positions, then all of them become final."""
        cache = self._pick(data)
        if cache is not None and cache.resize(max(cache.capacity, cache.num_committed_tokens + n)):
            self._commit(cache, n)

    def _commit(self, cache, n):
        script = self.scripts[cache.id]
        done = cache.num_committed_tokens
        k = min(n, cache.capacity - done, len(script) - done)
        if k <= 0:
            return
        total = done + k
        # Blocks this commit completes: write their final bytes first (they become read-only).
        b = cache.num_committed_blocks
        while self.config.enable_block_reuse:
            end = (b + 1) * self.tpb
            if end > total or (self.config.successor_aware and end >= total):
                break
            assert cache.is_writable(b)
            self._write_block(cache.block_table[b], self._block_tokens(script, b))
            b += 1
        cache.commit(script[done:total])
        assert cache.num_committed_blocks == b
        assert cache.history_length >= total

    @rule(data=st.data(), n=st.integers(1, 9))
    def rewind(self, data, n):
        cache = self._pick(data)
        if cache is None:
            return
        target = max(cache.history_length, cache.capacity - n)
        cache.resize(target)
        assert cache.capacity == target

    @rule(data=st.data())
    def free(self, data):
        cache = self._pick(data)
        if cache is None:
            return
        cache.close()
        del self.scripts[cache.id]

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        cached = self.m.stats().num_cached_slots
        assert self.m.evict(n) == min(n, cached)

    @invariant()
    def integrity(self):
        self.m.check_integrity()

    @invariant()
    def committed_blocks_hold_their_prefix_bytes(self):
        for cache in self.m.live_caches:
            script = self.scripts[cache.id]
            for b in range(cache.num_committed_blocks):
                slot = cache.block_table[b]
                tokens = self._block_tokens(script, b)
                for i, pool in enumerate(self.pools):
                    assert torch.equal(pool[slot], content(i, pool.shape[1], tokens)), (
                        cache.id,
                        b,
                        slot,
                    )

    def teardown(self):
        for cache in self.m.live_caches:
            cache.close()
        self.m.check_integrity()
        stats = self.m.stats()
        assert stats.num_used_slots == 0
        assert stats.num_free_slots + stats.num_cached_slots == self.m.num_slots


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_random_life_cycles_keep_every_invariant(layout):
    machine = type(f"Machine_{layout}", (CacheMachine,), {"config": LAYOUTS[layout]})
    run_state_machine_as_test(
        machine, settings=settings(max_examples=120, stateful_step_count=40, deadline=None)
    )
