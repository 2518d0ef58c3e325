"""Prefix affinity for attention DP: send a prompt to the rank whose prefix cache may hold it.

Each rank reuses KV only from its own cache, so a conversation's next turn reuses its earlier
turns (and the drafter's KV in the same slots) only if it lands on the same rank. Rank 0 records,
for every prompt it hands out, the rank that took each of its block-aligned prefixes (a chain of
per-block hashes, as the ranks' radix trees key their blocks) and looks up the longest prefix of a
new prompt it has seen. The record is bounded (least recently used prefixes go first) and
approximate: a rank may since have evicted the blocks, which costs only a prefill.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixAffinity:
    def __init__(self, tokens_per_block: int, capacity: int = 1 << 16) -> None:
        self.tokens_per_block = tokens_per_block
        self.capacity = capacity
        self._rank_of: OrderedDict[int, int] = OrderedDict()  # prefix chain hash -> rank

    def _chain(self, tokens: list[int]) -> list[int]:
        """The hash of every full-block prefix of ``tokens``, shortest first."""
        chain, h, tpb = [], 0, self.tokens_per_block
        for start in range(0, len(tokens) - tpb + 1, tpb):
            h = hash((h, tuple(tokens[start : start + tpb])))
            chain.append(h)
        return chain

    def rank_for(self, tokens: list[int]) -> int | None:
        """The rank that took the longest recorded prefix of ``tokens`` (None: none recorded)."""
        for h in reversed(self._chain(tokens)):
            if h in self._rank_of:
                self._rank_of.move_to_end(h)
                return self._rank_of[h]
        return None

    def record(self, tokens: list[int], rank: int) -> None:
        for h in self._chain(tokens):
            self._rank_of[h] = rank
            self._rank_of.move_to_end(h)
        while len(self._rank_of) > self.capacity:
            self._rank_of.popitem(last=False)


def choose_rank(loads: list[int], preferred: int | None, slack: int) -> int:
    """``preferred`` unless it has more than ``slack`` unfinished requests beyond the least loaded
    rank; else the least loaded rank (the lowest on a tie)."""
    least = loads.index(min(loads))
    if preferred is not None and loads[preferred] <= loads[least] + slack:
        return preferred
    return least
