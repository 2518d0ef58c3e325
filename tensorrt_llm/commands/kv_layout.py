"""``trtllm-kv-layout``: print the slot layout of a KV cache, of a checkpoint or described in YAML.

``trtllm-kv-layout --model DIR [--speculative-model DIR | --mtp]`` reads a checkpoint's
``config.json`` (a published MiniMax-M3's: index-K on exactly the layers ``layer_types`` makes
sparse) and appends the drafter's layer as the unified cache holds it: an Eagle3 drafter's as
sub-pages of the same slots, the model's own MTP module's as one more sparse layer.
Only the configs are read, nothing is allocated, so the full model's layout prints anywhere.

``trtllm-kv-layout LAYOUT.yaml`` takes the engine's layers directly::

    tokens_per_block: 128          # optional, default 128
    num_slots: 64                  # or max_tokens: 8192
    alignment_bytes: 256           # optional
    kernel_page_tokens: 32         # optional
    defaults: {num_kv_heads: 2, head_dim: 64, dtype: bfloat16}   # or fp8 (rows + scales)
    layers:
      - {layer_id: 0}
      - {layer_id: 1, index_key: {num_heads: 1, head_dim: 64}}
      - {layer_id: 2, num_kv_heads: 4, draft: true}   # an Eagle3 draft layer

With ``--simulate``, two requests that share a prefix run through the cache and their block tables,
the reuse and the slot states are printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import yaml

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.draft_subpage_view import (
    resolve_subpage_tokens,
)
from tensorrt_llm._torch.models.checkpoint import load_config
from tensorrt_llm._torch.models.modeling_minimaxm3_mtp import mtp_kv_cache_layer
from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config
from tensorrt_llm._torch.pyexecutor.config import KV_DTYPES, KV_STORAGE_DTYPES, KvCacheLayer
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import engine_layer
from tensorrt_llm.runtime.kv_cache_manager_v2 import (
    DEFAULT_LIFE_CYCLE,
    AttentionLayerConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)

_TOP_KEYS = {
    "tokens_per_block",
    "num_slots",
    "max_tokens",
    "alignment_bytes",
    "kernel_page_tokens",
    "defaults",
    "layers",
    "enable_block_reuse",
}
_LAYER_KEYS = {"layer_id", "num_kv_heads", "head_dim", "dtype", "index_key", "draft", "life_cycle"}
_INDEX_KEYS = {"num_heads", "head_dim", "dtype"}


def _check_keys(where: str, mapping: dict, allowed: set[str]) -> None:
    if not isinstance(mapping, dict):
        raise ValueError(f"{where} must be a mapping, got {mapping!r}")
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def config_from_yaml(data: dict) -> KVCacheManagerConfig:
    """Build and validate an engine config from the YAML mapping described in the module docstring."""
    _check_keys("layout", data, _TOP_KEYS)
    _check_keys("defaults", data.get("defaults", {}), _LAYER_KEYS - {"layer_id"})
    defaults = {"dtype": "bfloat16", **data.get("defaults", {})}
    tpb = data.get("tokens_per_block", 128)
    if "layers" not in data or not data["layers"]:
        raise ValueError("layout: 'layers' is missing or empty")
    layers = []
    for i, raw in enumerate(data["layers"]):
        _check_keys(f"layers[{i}]", raw, _LAYER_KEYS)
        entry = {**defaults, **raw}
        entry["dtype"] = KV_STORAGE_DTYPES.get(entry["dtype"], entry["dtype"])
        for key in ("layer_id", "num_kv_heads", "head_dim"):
            if key not in entry:
                raise ValueError(f"layers[{i}]: missing {key!r} (and no default)")
        index_key = None
        if entry.get("index_key") is not None:
            _check_keys(f"layers[{i}].index_key", entry["index_key"], _INDEX_KEYS)
            ik = {
                "num_heads": 1,
                "head_dim": entry["head_dim"],
                "dtype": entry["dtype"],
                **entry["index_key"],
            }
            ik["dtype"] = KV_STORAGE_DTYPES.get(ik["dtype"], ik["dtype"])
            index_key = (ik["num_heads"], ik["head_dim"], ik["dtype"])
        layers.append(
            AttentionLayerConfig.kv(
                entry["layer_id"],
                entry["num_kv_heads"],
                entry["head_dim"],
                entry["dtype"],
                index_key=index_key,
                life_cycle=entry.get("life_cycle", DEFAULT_LIFE_CYCLE),
                depends_on_next_token=bool(entry.get("draft", False)),
            )
        )
    if ("num_slots" in data) == ("max_tokens" in data):
        raise ValueError("layout: give exactly one of 'num_slots' or 'max_tokens'")
    num_slots = data["num_slots"] if "num_slots" in data else math.ceil(data["max_tokens"] / tpb)
    options = {
        k: data[k]
        for k in ("alignment_bytes", "kernel_page_tokens", "enable_block_reuse")
        if k in data
    }
    return KVCacheManagerConfig(
        tokens_per_block=tpb, layers=tuple(layers), num_slots=num_slots, **options
    )


def config_from_checkpoint(
    model: Path,
    speculative_model: Path | None,
    tokens_per_block: int = 128,
    num_slots: int = 64,
    dtype: str | None = None,
    mtp: bool = False,
) -> KVCacheManagerConfig:
    """The engine config the creation site builds for ``model`` on one rank (KV in the config's
    dtype unless ``dtype``), with ``speculative_model``'s draft layer in the unified cache, or with
    ``mtp`` the model's MTP module's (one more sparse layer, whole pages)."""
    config = load_config(model)
    dtype = dtype or config.torch_dtype
    layers = config.kv_cache_layers()
    options = {}
    if mtp:
        if not getattr(config, "num_mtp_modules", 0):
            raise ValueError("--mtp: the checkpoint's config has no MTP module (num_mtp_modules)")
        layers += (dataclasses.replace(mtp_kv_cache_layer(config), is_draft=True),)
    elif speculative_model is not None:
        draft = Eagle3Config.from_pretrained(speculative_model)
        layers += (KvCacheLayer(draft.num_key_value_heads, draft.head_dim, is_draft=True),)
        options["kernel_page_tokens"] = resolve_subpage_tokens(tokens_per_block)
    return KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        layers=tuple(
            engine_layer(i, layer, dtype, layer.is_draft) for i, layer in enumerate(layers)
        ),
        num_slots=num_slots,
        **options,
    )


def simulate(manager: KVCacheManager) -> str:
    """Two requests sharing a prefix: the second reuses the first's committed blocks."""
    tpb = manager.tokens_per_block
    shared = list(range(1, 2 * tpb + 1))
    lines = []
    first = manager.create_kv_cache(shared + [7] * (tpb // 2))
    lines.append(
        f"request A: prompt {first.num_reused_tokens} reused, resize -> {first.resize(len(shared) + tpb // 2).status.value}"
    )
    first.commit(shared + [7] * (tpb // 2))
    lines.append(
        f"request A: block table {list(first.block_table)}, committed blocks {first.num_committed_blocks}"
    )
    first.close()
    second = manager.create_kv_cache(shared + [9] * tpb)
    lines.append(
        f"request B: {second.num_reused_tokens} tokens reused, block table {list(second.block_table)}"
    )
    if manager.config.successor_aware:
        lines.append(
            "  (block 1 is not reused: B's token after it differs from A's, and a draft layer's KV at a "
            "block's last position depends on that token)"
        )
    lines.append(
        f"request B: resize -> {second.resize(len(shared) + tpb).status.value}, block table {list(second.block_table)}"
    )
    manager.check_integrity()
    second.close()
    stats = manager.stats()
    lines.append(
        f"slots: free={stats.num_free_slots} used={stats.num_used_slots} cached={stats.num_cached_slots} "
        f"reuse hits={stats.num_reused_blocks}/{stats.num_lookup_blocks} blocks"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trtllm-kv-layout", description=__doc__.splitlines()[0])
    parser.add_argument(
        "layout", type=Path, nargs="?", help="YAML file describing the cache's layers"
    )
    parser.add_argument("--model", type=Path, help="a checkpoint directory (its config.json)")
    parser.add_argument(
        "--speculative-model", type=Path, help="an Eagle3 drafter for --model (unified cache)"
    )
    parser.add_argument(
        "--mtp", action="store_true", help="with --model: its MTP module's layer (unified cache)"
    )
    parser.add_argument("--tokens-per-block", type=int, default=128)
    parser.add_argument("--num-slots", type=int, default=64)
    parser.add_argument(
        "--dtype",
        choices=KV_DTYPES,
        default=None,
        help="the KV cache dtype (default: the model's); fp8: float8_e4m3fn rows and their scales",
    )
    parser.add_argument(
        "--simulate", action="store_true", help="also run two requests through the cache"
    )
    args = parser.parse_args(argv)
    if (args.layout is None) == (args.model is None):
        parser.error("give a LAYOUT.yaml or --model DIR (one of them)")
    if (args.speculative_model is not None or args.mtp) and args.model is None:
        parser.error("--speculative-model and --mtp need --model")
    if args.speculative_model is not None and args.mtp:
        parser.error("--speculative-model or --mtp: one drafter")
    source = args.layout or args.model
    try:
        if args.model is not None:
            config = config_from_checkpoint(
                args.model,
                args.speculative_model,
                args.tokens_per_block,
                args.num_slots,
                args.dtype,
                args.mtp,
            )
        else:
            config = config_from_yaml(yaml.safe_load(args.layout.read_text()) or {})
        manager = KVCacheManager(config)
    except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
        print(f"trtllm-kv-layout: {source}: {exc}", file=sys.stderr)
        return 2
    print(manager.describe())
    if args.simulate:
        print(simulate(manager))
    return 0


if __name__ == "__main__":
    sys.exit(main())
