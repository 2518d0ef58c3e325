"""Mapping: which rank this process is and how the ranks split the work (upstream's names).

Two layouts, both over ``world_size = tp_size`` ranks (no pipeline parallelism in this fork):

- tensor parallelism (``enable_attention_dp=False``): every layer's heads and MLP columns are split
  over the ranks, which run every request together (one executor per rank, kept in step by rank 0);
  each rank's KV cache holds its own KV heads' slots, with the drafter's sub-pages beside them;
- attention data parallelism (``enable_attention_dp=True``): attention and the dense layers are
  replicated, each rank runs its own requests with its own scheduler and KV cache (the unified
  cache on every rank), and rank 0 spreads the requests over the ranks (``attn_tp_size == 1``).

The routed experts of the MoE layers are split by their own two sizes (upstream's names), whose
product is ``tp_size`` (under attention DP it may also be 1: every rank holds every expert): ``moe_ep_size`` ranks each hold ``num_experts / moe_ep_size`` whole experts
(expert parallelism), and ``moe_tp_size`` ranks each hold a slice of every expert's intermediate
(MoE tensor parallelism). Rank ``r`` is expert group ``r // moe_tp_size`` and intermediate slice
``r % moe_tp_size``. Under tensor-parallel attention every rank holds the same tokens, so each
computes its share and one all-reduce sums the shares; under attention DP each rank's tokens travel
by all-to-all to the ranks holding their experts and back (``moe_tp_size`` must then be 1). The
router and the shared expert are not split by these sizes.

Rank ``r`` runs on ``cuda:r`` (or the CPU, over gloo).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_RULE = "moe_expert_parallel_size * moe_tensor_parallel_size must equal tensor_parallel_size"


def _moe_layout(tp_size: int, adp: bool, ep: int | None, tp: int | None) -> tuple[int, int]:
    """``(moe_ep_size, moe_tp_size)`` from what was given (None: not given); an error names the
    options and the rule a layout breaks."""
    for name, size in (("moe_expert_parallel_size", ep), ("moe_tensor_parallel_size", tp)):
        if size is not None and size < 1:
            raise ValueError(f"{name}={size} must be >= 1")
        if size is not None and tp_size % size:
            raise ValueError(
                f"{name}={size} does not divide tensor_parallel_size={tp_size}: {_RULE}"
            )
    if adp:
        if (tp or 1) > 1:
            raise ValueError(
                f"moe_tensor_parallel_size={tp} with enable_attention_dp: under attention DP each "
                "rank's tokens go to the ranks holding their experts, so the experts are split "
                f"whole: set moe_expert_parallel_size={tp_size} (moe_tensor_parallel_size=1)"
            )
        if (ep or 1) not in (1, tp_size):
            raise ValueError(
                f"moe_expert_parallel_size={ep} with enable_attention_dp and "
                f"tensor_parallel_size={tp_size}: under attention DP the experts are split over "
                f"every rank ({tp_size}) or replicated on each (1)"
            )
        return ep or 1, 1
    if ep is None:
        ep = 1 if tp is None else tp_size // tp
    tp = tp_size // ep if tp is None else tp
    if ep * tp != tp_size:
        raise ValueError(
            f"moe_expert_parallel_size * moe_tensor_parallel_size != tensor_parallel_size: "
            f"{ep} * {tp} != {tp_size} ({_RULE})"
        )
    return ep, tp


@dataclass(frozen=True)
class Mapping:
    world_size: int = 1
    tp_size: int = 1
    rank: int = 0
    enable_attention_dp: bool = False
    # None: derived from the other; neither given: MoE TP over every rank under TP attention,
    # the experts replicated under attention DP
    moe_ep_size: int | None = None
    moe_tp_size: int | None = None

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
        ep, tp = _moe_layout(
            self.tp_size, self.enable_attention_dp, self.moe_ep_size, self.moe_tp_size
        )
        object.__setattr__(self, "moe_ep_size", ep)
        object.__setattr__(self, "moe_tp_size", tp)

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

    @property
    def moe_ep_rank(self) -> int:
        """This rank's expert group (0 where the experts are replicated: attention DP, EP 1)."""
        return self.rank // self.moe_tp_size % self.moe_ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def moe_all_to_all(self) -> bool:
        """Whether the MoE layers exchange tokens between ranks (EP under attention DP): then
        every rank takes part in every step's forward, with tokens or without."""
        return self.enable_attention_dp and self.moe_ep_size > 1

    def local_experts(self, num_experts: int) -> range:
        """The experts this rank holds (an error when they do not split evenly)."""
        if num_experts % self.moe_ep_size:
            raise ValueError(
                f"num_local_experts={num_experts} is not divisible by "
                f"moe_expert_parallel_size={self.moe_ep_size}"
            )
        per_rank = num_experts // self.moe_ep_size
        return range(self.moe_ep_rank * per_rank, (self.moe_ep_rank + 1) * per_rank)

    def moe_shard(self, size: int) -> int:
        """This rank's slice of an expert's intermediate ``size`` (an error when it does not
        split evenly)."""
        if size % self.moe_tp_size:
            raise ValueError(
                f"intermediate_size={size} (each routed expert's) is not divisible by "
                f"moe_tensor_parallel_size={self.moe_tp_size}"
            )
        return size // self.moe_tp_size

    def for_rank(self, rank: int) -> Mapping:
        return dataclasses.replace(self, rank=rank)

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
        return f"{mode}{self.tp_size}-ep{self.moe_ep_size}-moetp{self.moe_tp_size}"
