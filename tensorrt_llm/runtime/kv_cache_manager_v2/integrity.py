"""``check_integrity``: every invariant of the engine, checked from scratch. torch-free.

Raises ``AssertionError`` (explicitly, so ``python -O`` keeps the checks) naming what broke.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from tensorrt_llm.runtime.kv_cache_manager_v2.block_pool import BlockPool
from tensorrt_llm.runtime.kv_cache_manager_v2.kv_cache import KVCache


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_integrity(
    pool: BlockPool, caches: Sequence[KVCache], num_slots: int, tokens_per_block: int
) -> None:
    """Every slot of ``pool`` in exactly one state (free, cached, held, private to one of
    ``caches``), the radix tree well formed, every cache's lengths and ref counts consistent."""
    state: dict[int, str] = {}

    def claim(slot: int, what: str) -> None:
        _require(0 <= slot < num_slots, f"slot {slot} out of range ({what})")
        _require(slot not in state, f"slot {slot} is both {state.get(slot)} and {what}")
        state[slot] = what

    for slot in pool.free_slots:
        claim(slot, "free")
    _check_tree(pool, claim)
    refs: Counter[int] = Counter()
    for cache in caches:
        _check_cache(pool, cache, tokens_per_block, refs)
        for slot in cache.private_slots():
            claim(slot, f"private to cache {cache.id}")
    for node in pool.tree:
        _require(
            node.ref_count == refs[id(node)],
            f"{node}: ref_count {node.ref_count} but {refs[id(node)]} caches hold it",
        )
    leaked = sorted(set(range(num_slots)) - set(state))
    _require(not leaked, f"{len(leaked)} slots are in no state (leaked): {leaked}")
    live = pool.evictable_nodes()
    for node in pool.tree:
        if node.ref_count == 0 and not node.children:
            _require(id(node) in live, f"evictable {node} has no eviction entry")


def _check_tree(pool: BlockPool, claim: Callable[[int, str], None]) -> None:
    num_cached = 0
    for node in pool.tree:
        claim(node.slot, "cached" if node.ref_count == 0 else "held")
        num_cached += node.ref_count == 0
        _require(node.ref_count >= 0, f"negative ref_count on {node}")
        if node.parent is not None:
            _require(
                pool.tree.get(node.parent.key) is node.parent, f"parent of {node} left the tree"
            )
            _require(
                node.parent.children.get(node.key) is node,
                f"{node} missing from its parent's children",
            )
            if node.ref_count > 0:
                _require(
                    node.parent.ref_count > 0, f"held {node} has an unheld parent {node.parent}"
                )
        for child in node.children.values():
            _require(child.parent is node, f"child {child} of {node} points elsewhere")
    _require(
        num_cached == pool.num_cached_slots,
        f"cached count {pool.num_cached_slots} != {num_cached} nodes",
    )


def _check_cache(pool: BlockPool, cache: KVCache, tpb: int, refs: Counter[int]) -> None:
    """One live cache's lengths and held nodes; counts its references into ``refs``."""
    _require(not cache.is_closed, f"closed cache {cache.id} still registered")
    _require(
        cache.num_committed_tokens
        <= cache.history_length
        <= cache.capacity
        <= cache.num_blocks * tpb,
        f"cache {cache.id}: committed={cache.num_committed_tokens} history={cache.history_length} "
        f"capacity={cache.capacity} blocks={cache.num_blocks}",
    )
    _require(
        cache.num_blocks == -(-cache.capacity // tpb),
        f"cache {cache.id}: blocks do not match capacity",
    )
    _require(
        cache.num_committed_blocks * tpb <= cache.num_committed_tokens,
        f"cache {cache.id}: a committed block holds uncommitted tokens",
    )
    nodes = cache.held_nodes()
    for b, node in enumerate(nodes):
        refs[id(node)] += 1
        _require(
            pool.tree.get(node.key) is node,
            f"cache {cache.id} holds block {b} that left the tree",
        )
        _require(
            node.parent is (nodes[b - 1] if b else None),
            f"cache {cache.id}: block {b}'s node is not the child of block {b - 1}'s",
        )
        if b not in cache._duplicate:
            _require(
                node.slot == cache.block_table[b], f"cache {cache.id}: block {b} slot mismatch"
            )
