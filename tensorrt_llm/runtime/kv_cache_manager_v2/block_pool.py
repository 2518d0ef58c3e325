"""Every slot id and its state: the free queue, the radix tree, reference counts, LRU eviction. torch-free.

A slot is in exactly one state at any time:

    FREE     in the free queue (FIFO: freed slots go to the back, allocation takes from the front)
    PRIVATE  owned by one sequence and not in the tree: the only state in which a slot is written
    HELD     a tree node with ref_count > 0: read-only, possibly shared by several sequences
    CACHED   a tree node with ref_count == 0: read-only, evictable once it is a leaf

Invariant: every ancestor of a HELD node is HELD (a sequence holds its whole committed chain), so the
CACHED nodes form subtrees hanging off the held part and can all be evicted leaf by leaf. Hence
``num_free_slots + num_cached_slots`` slots can always be allocated.

Eviction order: least recently released leaf first. A sequence releases its blocks tail first, so
within one sequence the deepest block is evicted first and prefixes survive longest.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

from tensorrt_llm.runtime.kv_cache_manager_v2.radix_tree import BlockKey, BlockNode, RadixTree


class BlockPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.tree = RadixTree()
        self._free: deque[int] = deque(range(num_slots))
        # (last_used, tie, node) for nodes that were evictable when pushed; validated on pop.
        self._evictable: list[tuple[int, int, BlockNode]] = []
        self._tie = itertools.count()
        self._clock = 0
        self.num_cached_slots = 0  # tree nodes with ref_count == 0
        self.num_evicted_total = 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_available_slots(self) -> int:
        """Slots an allocation can get right now: free ones plus evictable cached ones."""
        return len(self._free) + self.num_cached_slots

    @property
    def free_slots(self) -> tuple[int, ...]:
        return tuple(self._free)

    def allocate(self, num_slots: int) -> tuple[list[int], int] | None:
        """``num_slots`` private slots and how many cached blocks were evicted for them, or ``None``
        (and no change at all) when even evicting every cached block would not be enough."""
        if num_slots > self.num_available_slots:
            return None
        num_evicted = 0
        while len(self._free) < num_slots:
            self._evict_one()
            num_evicted += 1
        return [self._free.popleft() for _ in range(num_slots)], num_evicted

    def free(self, slots: Sequence[int]) -> None:
        """Return private slots, in the given order, to the back of the free queue."""
        self._free.extend(slots)

    def evict(self, num_slots: int) -> int:
        """Evict up to ``num_slots`` cached blocks (LRU leaves first); returns how many were evicted."""
        count = 0
        while count < num_slots and self.num_cached_slots:
            self._evict_one()
            count += 1
        return count

    def insert(self, key: BlockKey, slot: int, parent: BlockNode | None) -> BlockNode:
        """A private slot becomes a committed node held once (by the committing sequence)."""
        node = self.tree.insert(key, slot, parent)
        node.ref_count = 1
        return node

    def acquire(self, node: BlockNode) -> None:
        if node.ref_count == 0:
            self.num_cached_slots -= 1
        node.ref_count += 1

    def release(self, node: BlockNode) -> None:
        if node.ref_count <= 0:
            raise AssertionError(f"release of an unheld block {node}")
        node.ref_count -= 1
        if node.ref_count == 0:
            self.num_cached_slots += 1
            self._clock += 1
            node.last_used = self._clock
            self._push_if_evictable(node)

    def _push_if_evictable(self, node: BlockNode) -> None:
        if node.ref_count == 0 and not node.children:
            heapq.heappush(self._evictable, (node.last_used, next(self._tie), node))

    def _is_live_entry(self, stamp: int, node: BlockNode) -> bool:
        return (
            node.ref_count == 0
            and not node.children
            and node.last_used == stamp
            and self.tree.get(node.key) is node
        )

    def _evict_one(self) -> None:
        while self._evictable:
            stamp, _, node = heapq.heappop(self._evictable)
            if not self._is_live_entry(stamp, node):
                continue
            self.tree.remove_leaf(node)
            self.num_cached_slots -= 1
            self.num_evicted_total += 1
            self._free.append(node.slot)
            if node.parent is not None:
                self._push_if_evictable(node.parent)
            return
        raise AssertionError("a cached block exists but none is an evictable leaf")

    def evictable_nodes(self) -> set[int]:
        """ids of nodes with a live eviction entry (for integrity checks)."""
        return {id(node) for stamp, _, node in self._evictable if self._is_live_entry(stamp, node)}
