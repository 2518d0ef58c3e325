"""What the benchmarks share: the models they measure and the machine they name. Imported by the
scripts beside it; not a benchmark itself.

Models: an M3-shaped random model (with its Eagle3 drafter) and the bundled M3-tiny checkpoint.

The M3-shaped model (``scale="full"``): vocab 32768, hidden 2048, intermediate 5632, 8 layers
(2 dense, then 6 MSA), 16 attention heads, 4 KV heads, head_dim 128, rotary_dim 64, MSA indexer
4 heads x 128, top-16 blocks of 128, 1 local block; bf16. Its drafter has the same attention
geometry (16 heads, 4 KV heads, head_dim 128), hidden 2048, intermediate 5632, a 32768-token draft
vocabulary, and captures target layers 1, 4, 7. ``scale="tiny"`` keeps the layer structure (8
layers, 2 dense, captures 1, 4, 7) with small widths, for a CPU smoke test.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3Config
from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET

LAYERS_TO_CAPTURE = (1, 4, 7)

_WIDTHS = {
    # vocab, hidden, intermediate, heads, kv heads, head_dim, rotary_dim, index heads, index dim, top-k
    "full": (32768, 2048, 5632, 16, 4, 128, 64, 4, 128, 16),
    "tiny": (512, 64, 128, 4, 2, 16, 8, 2, 16, 2),
}


def bench_target_config(
    scale: str = "full", max_position_embeddings: int = 2048
) -> MiniMaxM3Config:
    """The M3-shaped target (see the module docstring)."""
    vocab, hidden, inter, heads, kv_heads, head_dim, rotary, idx_heads, idx_dim, top_k = _WIDTHS[
        scale
    ]
    return MiniMaxM3Config.from_dict(
        {
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": 8,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rotary_dim": rotary,
            "max_position_embeddings": max_position_embeddings,
            "torch_dtype": "bfloat16",
            "sparse_attention_config": {
                "index_n_heads": idx_heads,
                "index_head_dim": idx_dim,
                "topk_blocks": top_k,
                "block_size": 128,
                "num_local_blocks": 1,
                "num_dense_layers": 2,
            },
        }
    )


def bench_eagle3_config(target: MiniMaxM3Config) -> Eagle3Config:
    """A drafter of the target's attention geometry and widths, capturing layers 1, 4, 7."""
    return Eagle3Config.from_dict(
        {
            "hidden_size": target.hidden_size,
            "intermediate_size": target.intermediate_size,
            "num_attention_heads": target.num_attention_heads,
            "num_key_value_heads": target.num_key_value_heads,
            "head_dim": target.head_dim,
            "vocab_size": target.vocab_size,
            "draft_vocab_size": target.vocab_size,
            "target_hidden_size": target.hidden_size,
            "max_position_embeddings": target.max_position_embeddings,
            "eagle3_layers_to_capture": list(LAYERS_TO_CAPTURE),
        }
    )


def bundled_configs() -> tuple[MiniMaxM3Config, Eagle3Config]:
    """The bundled M3-tiny target and drafter configs (``examples/models/m3-tiny``)."""
    return (
        MiniMaxM3Config.from_pretrained(BUNDLED_TARGET),
        Eagle3Config.from_pretrained(BUNDLED_DRAFT),
    )


def machine_name(device: str) -> str:
    """The GPU's name, or the CPU's model name and the number of cores this process may use."""
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} CPU, {cores} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
