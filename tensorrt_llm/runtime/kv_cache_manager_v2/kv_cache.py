"""One sequence's KV cache: its block table and its three lengths. torch-free.

Lengths are in tokens (positions) and always satisfy::

    num_committed_tokens <= history_length <= capacity <= num_blocks * tokens_per_block

- ``capacity``: positions that have a slot (history plus the next step's input, drafts included).
  ``resize`` grows it (allocating slots) or shrinks it to rewind rejected drafts; never below history.
- ``history_length``: positions whose KV has been written by a finished step. Never decreases.
- ``num_committed_tokens``: tokens whose KV is final in **every** layer (verified tokens, and for an
  Eagle3 draft layer, positions whose successor was known when the drafter ran). ``commit(tokens)``
  appends them; full blocks of committed tokens enter the radix tree and become read-only.

Block states, by block index::

    [0, num_committed_blocks)        committed: tree nodes, read-only (reused or committed here)
    [num_committed_blocks, num_blocks) private: written by this sequence's steps

**The drafter boundary rule.** An Eagle3 draft layer's KV at position i depends on
token i+1, so the last position of block b depends on the first token of block b+1. We use
**successor-aware keys**: when the layout has such a layer, a block's key also covers its successor
token, and block b is committed only once token ``(b+1) * tokens_per_block`` is committed too. A
block is therefore reused only by a sequence whose next token is the same, and a reused slot's draft
sub-pages are exactly what a cold prefill of that prompt writes. We chose this over upstream's
backoff-with-evidence because the key alone proves validity: no second lookup, no per-node evidence
list, and a prompt that shares a block but not its successor simply misses that one block (it
recomputes it into a private slot, never into the shared one). The price is that a sequence's last
full block is committed one token later than it would be without a drafter.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorrt_llm.runtime.kv_cache_manager_v2.block_pool import BlockPool
from tensorrt_llm.runtime.kv_cache_manager_v2.config import KVCacheManagerConfig
from tensorrt_llm.runtime.kv_cache_manager_v2.radix_tree import (
    BlockKey,
    BlockNode,
    chained_block_key,
    num_keyable_blocks,
)


class AllocationStatus(enum.Enum):
    OK = "ok"  # satisfied from free slots
    OK_AFTER_EVICTION = "ok_after_eviction"  # satisfied after evicting cached (unreferenced) blocks
    CANNOT_ALLOCATE = "cannot_allocate"  # not enough free + cached slots; nothing was changed


@dataclass(frozen=True)
class AllocationResult:
    """What ``resize`` did. ``num_missing`` is how many more slots would have been needed."""

    status: AllocationStatus
    num_new_slots: int = 0
    num_evicted: int = 0
    num_missing: int = 0

    @property
    def ok(self) -> bool:
        return self.status is not AllocationStatus.CANNOT_ALLOCATE

    def __bool__(self) -> bool:
        return self.ok


class KVCache:
    """Created by ``KVCacheManager.create_kv_cache``; call ``close()`` when the sequence ends.

    It allocates from and releases to ``pool`` under ``config``'s rules, and calls ``on_close``
    (the manager's bookkeeping) once, when closed.
    """

    def __init__(
        self,
        pool: BlockPool,
        config: KVCacheManagerConfig,
        cache_id: int,
        root: BlockKey,
        reused: Sequence[BlockNode],
        reused_tokens: Sequence[int],
        on_close: Callable[[KVCache], None] | None = None,
    ) -> None:
        self._pool = pool
        self._config = config
        self._on_close = on_close
        self.id = cache_id
        self.tokens_per_block = config.tokens_per_block
        self._root = root
        self._slots: list[int] = [node.slot for node in reused]  # the block table
        self._nodes: list[BlockNode] = list(reused)  # committed blocks, a prefix of the table
        self._keys: list[BlockKey] = [node.key for node in reused]
        # Committed blocks whose slot stayed private: another sequence committed the same key first.
        self._duplicate: set[int] = set()
        self._tokens: list[int] = list(reused_tokens)
        self._capacity = len(reused_tokens)
        self._history = len(reused_tokens)
        self.num_reused_tokens = len(reused_tokens)
        self._closed = False

    # ---- lengths and tables -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def history_length(self) -> int:
        return self._history

    @property
    def num_committed_tokens(self) -> int:
        return len(self._tokens)

    @property
    def committed_tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def num_blocks(self) -> int:
        return len(self._slots)

    @property
    def num_committed_blocks(self) -> int:
        return len(self._nodes)

    @property
    def block_table(self) -> tuple[int, ...]:
        """Slot id per logical block. Valid until the next ``resize``/``close`` of this cache."""
        return tuple(self._slots)

    @property
    def is_closed(self) -> bool:
        return self._closed

    def is_writable(self, block_index: int) -> bool:
        """True when this sequence may write the block: it is private and not yet committed."""
        return len(self._nodes) <= block_index < len(self._slots)

    def private_slots(self) -> list[int]:
        """Slots this sequence owns outright (returned to the free queue on close)."""
        return [
            s for b, s in enumerate(self._slots) if b >= len(self._nodes) or b in self._duplicate
        ]

    def held_nodes(self) -> list[BlockNode]:
        return list(self._nodes)

    # ---- transitions --------------------------------------------------------------------------
    def resize(self, capacity: int, history_length: int | None = None) -> AllocationResult:
        """Grow or shrink to ``capacity`` positions (and optionally advance ``history_length``).

        Growing takes slots from the free queue, evicting cached blocks if needed; if that is not
        enough, nothing changes and the result says ``CANNOT_ALLOCATE``. Shrinking frees tail blocks.
        """
        self._check_open()
        history = self._history if history_length is None else history_length
        if history < self._history:
            raise ValueError(f"history_length={history} would decrease it (now {self._history})")
        if history < len(self._tokens):
            raise ValueError(
                f"history_length={history} is below the {len(self._tokens)} committed tokens"
            )
        if capacity < history:
            raise ValueError(
                f"capacity={capacity} is below history_length={history}: cannot rewind past history"
            )
        num_blocks = -(-capacity // self.tokens_per_block)
        max_blocks = self._config.max_blocks_per_seq
        if max_blocks is not None and num_blocks > max_blocks:
            raise ValueError(
                f"capacity={capacity} needs {num_blocks} blocks, more than max_blocks_per_seq={max_blocks}"
            )
        result = AllocationResult(AllocationStatus.OK)
        delta = num_blocks - len(self._slots)
        if delta > 0:
            got = self._pool.allocate(delta)
            if got is None:
                return AllocationResult(
                    AllocationStatus.CANNOT_ALLOCATE,
                    num_missing=delta - self._pool.num_available_slots,
                )
            slots, num_evicted = got
            self._slots.extend(slots)
            status = AllocationStatus.OK_AFTER_EVICTION if num_evicted else AllocationStatus.OK
            result = AllocationResult(status, num_new_slots=delta, num_evicted=num_evicted)
        elif delta < 0:
            tail = self._slots[num_blocks:]
            del self._slots[num_blocks:]
            self._pool.free(list(reversed(tail)))
        self._capacity = capacity
        self._history = history
        return result

    def commit(self, tokens: Sequence[int]) -> None:
        """Append tokens whose KV is final in every layer; full blocks of them enter the radix tree."""
        self._check_open()
        if len(self._tokens) + len(tokens) > self._capacity:
            raise ValueError(
                f"commit of {len(tokens)} tokens after {len(self._tokens)} exceeds capacity={self._capacity}"
            )
        self._tokens.extend(int(t) for t in tokens)
        self._history = max(self._history, len(self._tokens))
        if self._config.enable_block_reuse:
            self._commit_full_blocks()

    def _commit_full_blocks(self) -> None:
        tpb = self.tokens_per_block
        successor_aware = self._config.successor_aware
        for b in range(
            len(self._nodes), num_keyable_blocks(len(self._tokens), tpb, successor_aware)
        ):
            parent = self._nodes[-1] if self._nodes else None
            key = chained_block_key(
                self._keys[-1] if self._keys else self._root, self._tokens, b, tpb, successor_aware
            )
            node = self._pool.tree.get(key)
            if node is None:
                node = self._pool.insert(key, self._slots[b], parent)
            else:
                self._pool.acquire(node)
                self._duplicate.add(b)
            self._nodes.append(node)
            self._keys.append(key)

    def close(self) -> None:
        """Release everything, tail first: private slots to the free queue, nodes to the cache."""
        self._check_open()
        for b in range(len(self._slots) - 1, -1, -1):
            if b < len(self._nodes):
                if b in self._duplicate:
                    self._pool.free([self._slots[b]])
                self._pool.release(self._nodes[b])
            else:
                self._pool.free([self._slots[b]])
        self._slots.clear()
        self._nodes.clear()
        self._closed = True
        if self._on_close is not None:
            self._on_close(self)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"KV cache {self.id} is closed")
