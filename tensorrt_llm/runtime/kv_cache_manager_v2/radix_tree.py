"""The radix tree of committed full blocks, keyed by a chained SHA-256. torch-free.

A block's key is ``SHA-256(parent_key || block tokens [|| successor token])`` where the first block's
parent is the **root key** ``SHA-256(reuse scope)``. Because each key covers its parent's key, equal keys
mean equal token prefixes (up to SHA-256 collisions), so a lookup is one dict access per block while
the parent/child links keep the tree shape that eviction needs (only leaves are evicted, so every
cached block stays reachable from the root).

The successor token is part of the key when the layout has a layer whose KV depends on the next token
(an Eagle3 draft layer): its KV at a block's last position was computed from the first token of the
next block, so the block's bytes are only valid for that successor. See ``kv_cache.py`` for when a
block is committed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockKey = bytes


def root_key(reuse_scope: str | None) -> BlockKey:
    """The key every chain starts from; different scopes (salts, adapters) never share blocks."""
    scope = b"" if reuse_scope is None else reuse_scope.encode("utf-8")
    return hashlib.sha256(b"trtllm-kv-root\x00" + scope).digest()


def block_key(parent: BlockKey, tokens: Sequence[int], successor: int | None) -> BlockKey:
    """Key of a full block: parent key, its tokens (int64 LE) and, if given, the successor token."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if successor is not None:
        h.update(b"\x01" + struct.pack("<q", successor))
    return h.digest()


def chained_block_key(
    parent: BlockKey,
    tokens: Sequence[int],
    block_index: int,
    tokens_per_block: int,
    successor_aware: bool,
) -> BlockKey:
    """Key of block ``block_index`` of ``tokens`` given its parent's key (the successor token is
    ``tokens[(block_index + 1) * tokens_per_block]`` and must exist when ``successor_aware``)."""
    end = (block_index + 1) * tokens_per_block
    successor = tokens[end] if successor_aware else None
    return block_key(parent, tokens[block_index * tokens_per_block : end], successor)


def num_keyable_blocks(num_tokens: int, tokens_per_block: int, successor_aware: bool) -> int:
    """Full blocks of ``num_tokens`` tokens whose key is known (successor-aware keys need one more)."""
    return max(0, num_tokens - int(successor_aware)) // tokens_per_block


@dataclass(eq=False)
class BlockNode:
    """A committed block. ``ref_count`` counts live sequences holding it; 0 means cached (evictable
    once it has no children). ``last_used`` is a logical clock stamp set when the count drops to 0."""

    key: BlockKey
    slot: int
    parent: BlockNode | None
    children: dict[BlockKey, BlockNode] = field(default_factory=dict)
    ref_count: int = 0
    last_used: int = 0

    def __repr__(self) -> str:
        return f"BlockNode(slot={self.slot}, ref={self.ref_count}, children={len(self.children)})"


class RadixTree:
    """Key -> node, with parent/child links. Knows nothing of slots' states; ``BlockPool`` does."""

    def __init__(self) -> None:
        self._nodes: dict[BlockKey, BlockNode] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self):
        return iter(self._nodes.values())

    def get(self, key: BlockKey) -> BlockNode | None:
        return self._nodes.get(key)

    def insert(self, key: BlockKey, slot: int, parent: BlockNode | None) -> BlockNode:
        if key in self._nodes:
            raise KeyError("block key already in the radix tree")
        node = BlockNode(key=key, slot=slot, parent=parent)
        self._nodes[key] = node
        if parent is not None:
            parent.children[key] = node
        return node

    def remove_leaf(self, node: BlockNode) -> None:
        if node.children:
            raise ValueError("only leaves leave the radix tree")
        del self._nodes[node.key]
        if node.parent is not None:
            del node.parent.children[node.key]
