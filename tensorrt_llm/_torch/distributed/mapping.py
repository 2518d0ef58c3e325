"""Mapping: which rank this process is and how the ranks split the work (upstream's names).

Two layouts, both over ``world_size = tp_size`` ranks (no pipeline parallelism in this fork):

- tensor parallelism (``enable_attention_dp=False``): every layer's heads and MLP columns are split
  over the ranks, which run every request together (one executor per rank, kept in step by rank 0);
  each rank's KV cache holds its own KV heads' slots, with the drafter's sub-pages beside them;
- attention data parallelism (``enable_attention_dp=True``): weights are replicated, each rank runs
  its own requests with its own scheduler and KV cache (the unified cache on every rank), and rank
  0 spreads the requests over the ranks. The model here is dense, so nothing is split
  (``attn_tp_size == 1``); an MoE model would split its experts across the same ranks.

Rank ``r`` runs on ``cuda:r`` (or the CPU, over gloo).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    world_size: int = 1
    tp_size: int = 1
    rank: int = 0
    enable_attention_dp: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tp_size} must be >= 1")
        if self.world_size != self.tp_size:
            raise ValueError(
                f"world_size={self.world_size} must equal tensor_parallel_size={self.tp_size} "
                "(this fork has no pipeline parallelism)"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is not in [0, world_size={self.world_size})")

    @property
    def tp_rank(self) -> int:
        return self.rank

    @property
    def attn_tp_size(self) -> int:
        """Ranks one layer's weights are split over: 1 under attention DP (replicated)."""
        return 1 if self.enable_attention_dp else self.tp_size

    @property
    def attn_tp_rank(self) -> int:
        return 0 if self.enable_attention_dp else self.tp_rank

    @property
    def dp_size(self) -> int:
        """Ranks that each run their own requests: ``tp_size`` under attention DP, else 1."""
        return self.tp_size if self.enable_attention_dp else 1

    def for_rank(self, rank: int) -> Mapping:
        return Mapping(self.world_size, self.tp_size, rank, self.enable_attention_dp)

    def shard(self, size: int, what: str) -> int:
        """This rank's part of ``size`` split ``attn_tp_size`` ways (an error names ``what``)."""
        if size % self.attn_tp_size:
            raise ValueError(
                f"{what}={size} is not divisible by tensor_parallel_size={self.attn_tp_size}"
            )
        return size // self.attn_tp_size

    def kv_head_shard(self, num_kv_heads: int, what: str) -> tuple[int, int, int]:
        """This rank's KV heads as ``(local heads, shards, shard index)``: the heads split
        ``attn_tp_size`` ways, or, with fewer KV heads than ranks, one head per rank, replicated
        over the ``attn_tp_size / num_kv_heads`` ranks whose query heads read it."""
        tp = self.attn_tp_size
        if num_kv_heads % tp == 0:
            return num_kv_heads // tp, tp, self.attn_tp_rank
        if tp % num_kv_heads == 0:
            return 1, num_kv_heads, self.attn_tp_rank * num_kv_heads // tp
        raise ValueError(
            f"{what}={num_kv_heads} and tensor_parallel_size={tp}: one must divide the other"
        )

    def describe(self) -> str:
        """What the layout fingerprint of a KV transfer records of the layout."""
        mode = "adp" if self.enable_attention_dp else "tp"
        return f"{mode}{self.tp_size}"
