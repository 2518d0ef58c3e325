"""KV capacity at a fixed memory budget: the unified cache against the separate draft manager.

For each model, the KV cache managers are built by the creation site (``create_kv_cache_managers``)
with a one-slot pool, and their real slot layouts are read: with ``draft_kv_cache=unified`` one slot
holds every target buffer and the drafter's K and V; with ``separate`` each logical block costs a
target slot plus a draft slot (the draft manager has as many slots as the target's). The budget
divided by the bytes per 128-token logical block gives the blocks, hence the tokens and the
concurrent requests of ``--request-tokens`` (prompt + generation) each, plus the positions a
speculative step holds past a sequence (``2 * max_draft_len``), that fit. Target-only decoding is
shown for reference. The ratio: tokens that fit with the unified cache / with the separate draft
manager (and each mode's tokens / target-only's). Exact arithmetic on the layouts: the numbers do
not depend on the machine (the table names the one that computed them).

``--kv-dtypes bfloat16,fp8`` computes each KV dtype's rows; the last column is then the tokens that
fit at that dtype / at the first (an FP8 slot holds every row in one byte per element plus a float32
scale per token and head, so the same budget, hence the same ``free_gpu_memory_fraction``, holds
that many more slots).

    python benchmarks/bench_kv_capacity.py [--budget-gib 16] [--request-tokens 8192] [--max-draft-len 3] [--kv-dtypes bfloat16,fp8]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench_common import bench_eagle3_config, bench_target_config, bundled_configs, machine_name

from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3Config
from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.config import KvCacheOptions, PyExecutorConfig
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig
from tensorrt_llm.logger import logger

MODES = ("target only", "eagle3 separate", "eagle3 unified")


@dataclass(frozen=True)
class Capacity:
    """What one logical block costs in one mode, and what a budget holds.

    ``slot_bytes`` / ``used_bytes``: per manager (target, then the separate draft manager if any);
    ``used`` is the sum of the buffers' sizes, the rest of a slot is alignment and page padding.
    ``blocks_per_request``: logical blocks one request of the benchmark's length holds at most.
    """

    model: str
    mode: str
    kv_dtype: str
    tokens_per_block: int
    slot_bytes: tuple[int, ...]
    used_bytes: tuple[int, ...]
    blocks_per_request: int
    budget_bytes: int

    @property
    def bytes_per_block(self) -> int:
        return sum(self.slot_bytes)

    @property
    def padding_bytes(self) -> int:
        return sum(self.slot_bytes) - sum(self.used_bytes)

    @property
    def num_blocks(self) -> int:
        return self.budget_bytes // self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    @property
    def num_requests(self) -> int:
        return self.num_blocks // self.blocks_per_request


def measure(
    model: str,
    configs: tuple[MiniMaxM3Config, Eagle3Config],
    mode: str,
    budget_bytes: int,
    request_tokens: int = 8192,
    max_draft_len: int = 3,
    kv_dtype: str = "bfloat16",
) -> Capacity:
    """Build ``mode``'s managers for the (target, drafter) ``configs`` with a one-slot pool and read
    their slot layouts (``kv_dtype`` KV)."""
    target, draft = configs
    spec = (
        None
        if mode == "target only"
        else Eagle3SpecConfig(max_draft_len, "unused", draft_kv_cache=mode.removeprefix("eagle3 "))
    )
    config = PyExecutorConfig(
        max_batch_size=1,
        max_num_tokens=request_tokens,
        max_seq_len=request_tokens,
        kv_cache=KvCacheOptions(tokens_per_block=128, dtype=kv_dtype, max_tokens=128),
        speculative=spec,
    )
    geometry = None if spec is None else (draft.num_key_value_heads, draft.head_dim)
    managers = list(create_kv_cache_managers(target, config, geometry).values())
    assert all(m.num_pools == 1 and m.blocks_in_primary_pool == 1 for m in managers)
    return Capacity(
        model=model,
        mode=mode,
        kv_dtype=kv_dtype,
        tokens_per_block=managers[0].tokens_per_block,
        slot_bytes=tuple(m.slot_bytes() for m in managers),
        used_bytes=tuple(m.layout.pools[0].used_bytes for m in managers),
        blocks_per_request=managers[0].max_blocks_per_seq,
        budget_bytes=budget_bytes,
    )


def models() -> dict[str, tuple[MiniMaxM3Config, Eagle3Config]]:
    target = bench_target_config()
    return {
        "published (bench)": (target, bench_eagle3_config(target)),
        "m3-tiny": bundled_configs(),
    }


def run(
    budget_gib: float,
    request_tokens: int,
    max_draft_len: int,
    kv_dtypes: tuple[str, ...] = ("bfloat16",),
) -> list[Capacity]:
    budget = int(budget_gib * 2**30)
    return [
        measure(name, configs, mode, budget, request_tokens, max_draft_len, dtype)
        for dtype in kv_dtypes
        for name, configs in models().items()
        for mode in MODES
    ]


def print_table(rows: list[Capacity], budget_gib: float, request_tokens: int) -> None:
    first = rows[0].kv_dtype
    print(
        f"KV capacity at a {budget_gib:g} GiB budget, 128-token blocks, requests of "
        f"{request_tokens} tokens + the speculative extra positions"
    )
    print(f"exact arithmetic on the slot layouts (computed on {machine_name('cpu')})")
    print(
        f"{'model':<18} {'mode':<16} {'KV':<9} {'bytes / block':>17} {'padding':>8} "
        f"{'tokens':>10} {'blocks / req':>12} {'requests':>9} {'vs target only':>15} "
        f"{'unified / separate':>19} {'vs ' + first:>12}"
    )
    by_mode = {(r.model, r.mode, r.kv_dtype): r for r in rows}
    for r in rows:
        parts = " + ".join(str(b) for b in r.slot_bytes)
        vs_target = r.num_tokens / by_mode[r.model, "target only", r.kv_dtype].num_tokens
        ratio = (
            f"{r.num_tokens / by_mode[r.model, 'eagle3 separate', r.kv_dtype].num_tokens:.4f}"
            if r.mode == "eagle3 unified"
            else ""
        )
        vs_first = r.num_tokens / by_mode[r.model, r.mode, first].num_tokens
        line = (
            f"{r.model:<18} {r.mode:<16} {r.kv_dtype:<9} {parts:>17} {r.padding_bytes:>8} "
            f"{r.num_tokens:>10} {r.blocks_per_request:>12} {r.num_requests:>9} "
            f"{vs_target:>15.4f} {ratio:>19} {vs_first:>12.4f}"
        )
        print(line.rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--request-tokens", type=int, default=8192)
    parser.add_argument("--max-draft-len", type=int, default=3)
    parser.add_argument("--kv-dtypes", default="bfloat16", help="comma-separated KV dtypes")
    args = parser.parse_args()
    logger.set_level("warning")
    dtypes = tuple(args.kv_dtypes.split(","))
    rows = run(args.budget_gib, args.request_tokens, args.max_draft_len, dtypes)
    print_table(rows, args.budget_gib, args.request_tokens)


if __name__ == "__main__":
    main()
