"""The KV cache engine: storage layout + block life cycle for many sequences. torch-free.

    manager = KVCacheManager(config)
    cache = manager.create_kv_cache(prompt_tokens)   # reuses the longest committed prefix
    cache.resize(len(prompt_tokens))                  # slots for the rest (a result, never an exception)
    ... write KV at positions [cache.history_length, cache.capacity) ...
    cache.commit(prompt_tokens[cache.num_committed_tokens:])
    cache.close()

Tensors live elsewhere: ``pool.py`` allocates one tensor per pool from ``manager.layout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorrt_llm.runtime.kv_cache_manager_v2.block_pool import BlockPool
from tensorrt_llm.runtime.kv_cache_manager_v2.config import KVCacheManagerConfig
from tensorrt_llm.runtime.kv_cache_manager_v2.integrity import check_integrity
from tensorrt_llm.runtime.kv_cache_manager_v2.kv_cache import KVCache
from tensorrt_llm.runtime.kv_cache_manager_v2.layout import StorageLayout, plan_storage
from tensorrt_llm.runtime.kv_cache_manager_v2.radix_tree import (
    BlockNode,
    chained_block_key,
    root_key,
)


@dataclass(frozen=True)
class KVCacheStats:
    """Counts of slots by state, plus cumulative reuse and eviction counters."""

    num_slots: int
    num_free_slots: int
    num_used_slots: int  # private + held (referenced) committed
    num_cached_slots: int  # committed, unreferenced, evictable
    tokens_per_block: int
    num_lookup_blocks: int  # blocks looked up in the radix tree by create_kv_cache
    num_reused_blocks: int  # of which were found
    num_evicted_slots: int
    num_live_sequences: int  # sequences holding slots now


class KVCacheManager:
    def __init__(self, config: KVCacheManagerConfig) -> None:
        self.config = config
        self.layout: StorageLayout = plan_storage(config)
        self._pool = BlockPool(config.num_slots)
        self._caches: dict[int, KVCache] = {}
        self._next_id = 0
        self._num_lookup_blocks = 0
        self._num_reused_blocks = 0

    @property
    def tokens_per_block(self) -> int:
        return self.config.tokens_per_block

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def max_blocks_per_seq(self) -> int | None:
        return self.config.max_blocks_per_seq

    @property
    def num_free_slots(self) -> int:
        return self._pool.num_free_slots

    @property
    def num_available_slots(self) -> int:
        """Slots a ``resize`` could obtain now (free plus evictable cached)."""
        return self._pool.num_available_slots

    @property
    def free_slots(self) -> tuple[int, ...]:
        """The free queue, front first (the next allocation takes from the front)."""
        return self._pool.free_slots

    @property
    def live_caches(self) -> tuple[KVCache, ...]:
        return tuple(self._caches.values())

    # ---- sequences ----------------------------------------------------------------------------
    def _match_prefix(self, tokens: Sequence[int], reuse_scope: str | None) -> list[BlockNode]:
        """Committed blocks of ``tokens``, longest prefix first. At most ``(len - 1) // tpb`` blocks
        so at least one token is left to compute (and, with successor-aware keys, the successor of
        the last reused block is a prompt token)."""
        if not self.config.enable_block_reuse or len(tokens) < 2:
            return []
        key = root_key(reuse_scope)
        matched: list[BlockNode] = []
        for b in range((len(tokens) - 1) // self.tokens_per_block):
            key = chained_block_key(
                key, tokens, b, self.tokens_per_block, self.config.successor_aware
            )
            node = self._pool.tree.get(key)
            if node is None:
                break
            matched.append(node)
        return matched

    def probe_reuse(self, input_tokens: Sequence[int], reuse_scope: str | None = None) -> int:
        """How many leading tokens ``create_kv_cache`` would reuse now (changes nothing)."""
        return len(self._match_prefix(list(input_tokens), reuse_scope)) * self.tokens_per_block

    def create_kv_cache(
        self, input_tokens: Sequence[int] | None = None, reuse_scope: str | None = None
    ) -> KVCache:
        """A new sequence holding the longest committed prefix of ``input_tokens``. Allocates nothing
        else; its capacity and history start at the number of reused tokens."""
        tokens = [int(t) for t in (input_tokens or ())]
        matched = self._match_prefix(tokens, reuse_scope)
        if self.config.enable_block_reuse and len(tokens) >= 2:
            self._num_lookup_blocks += (len(tokens) - 1) // self.tokens_per_block
            self._num_reused_blocks += len(matched)
        for node in matched:
            self._pool.acquire(node)
        cache = KVCache(
            self._pool,
            self.config,
            self._next_id,
            root_key(reuse_scope),
            matched,
            tokens[: len(matched) * self.tokens_per_block],
            on_close=self._forget,
        )
        self._caches[cache.id] = cache
        self._next_id += 1
        return cache

    def _forget(self, cache: KVCache) -> None:
        del self._caches[cache.id]

    def evict(self, num_slots: int) -> int:
        """Evict up to ``num_slots`` cached blocks, least recently used leaves first."""
        return self._pool.evict(num_slots)

    # ---- observation --------------------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        cached = self._pool.num_cached_slots
        free = self._pool.num_free_slots
        return KVCacheStats(
            num_slots=self.num_slots,
            num_free_slots=free,
            num_used_slots=self.num_slots - free - cached,
            num_cached_slots=cached,
            tokens_per_block=self.tokens_per_block,
            num_lookup_blocks=self._num_lookup_blocks,
            num_reused_blocks=self._num_reused_blocks,
            num_evicted_slots=self._pool.num_evicted_total,
            num_live_sequences=len(self._caches),
        )

    def describe(self) -> str:
        return (
            self.layout.describe()
            + f"\nnum_slots={self.num_slots} tokens_capacity={self.num_slots * self.tokens_per_block}"
        )

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant; usable from tests after any step."""
        check_integrity(self._pool, self.live_caches, self.num_slots, self.tokens_per_block)
