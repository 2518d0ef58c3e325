"""What the benchmarks share: the models they measure and the machine they name. Imported by the
scripts beside it; not a benchmark itself.

Models: a random model of the published MiniMax-M3 architecture (with its Eagle3 drafter) and the
bundled M3-tiny checkpoint.

The benchmark target (``scale="full"``) has the published model's widths: vocab 200064, hidden
6144, 64 attention heads over 4 KV heads of 128, RoPE on 64 channels (theta 5e6), the indexer's 4
heads of 128 over key blocks of 128 (top-16, 1 local), experts and the shared expert of 3072, dense
MLPs of 12288, routed scaling 2.0; bf16. It has 8 layers arranged as the published model arranges
its first ones: layers 0-2 full attention with a dense MLP, layers 3-7 sparse attention (the
indexer) with the MoE (the published model's sparse layers are 3..59). Its MoE has 16 experts,
top-4, not the published 128, so that a model of 8 layers fits a benchmark's disk and memory (an
expert is the published size; only their number is cut). ``mlp="dense"`` makes every MLP dense
(12288), the variant to compare with dense references. The drafter has the target's attention
geometry (64 heads, 4 KV heads, head_dim 128), hidden 6144, intermediate 12288, the full draft
vocabulary, and captures target layers 1, 4, 7.

``scale="m3-slice"``: a slice of the published config itself, 128 experts top-4 included: 5 layers
(0-2 full attention with dense MLPs, 3-4 sparse attention with the MoE), its drafter capturing
layers 1, 2, 4. About 35 GB in bf16: built in device memory from its configs
(``load_format="dummy"``), never written to disk. ``scale="tiny"`` keeps the full scale's
structure (8 layers, captures 1, 4, 7) with small widths, for a CPU smoke test.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from tensorrt_llm._torch.models.configuration_minimaxm3 import MiniMaxM3Config
from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.tokenizer import (
    CHAT_ALPHABET,
    CHAT_SPECIAL_TOKENS,
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    build_char_tokenizer,
    plain_tokenizer_config,
)

NUM_FULL_LAYERS = 3  # the published model's first layers: full attention, dense MLPs
NUM_LAYERS = {"full": 8, "tiny": 8, "m3-slice": 5}
NUM_EXPERTS = {"full": 16, "tiny": 4, "m3-slice": 128}

_WIDTHS = {
    "full": dict(
        vocab_size=200064,
        hidden_size=6144,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=3072,
        shared_intermediate_size=3072,
        dense_intermediate_size=12288,
        num_local_experts=16,
        num_experts_per_tok=4,
        index_n_heads=4,
        index_head_dim=128,
        index_topk_blocks=16,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        shared_intermediate_size=32,
        dense_intermediate_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        index_n_heads=2,
        index_head_dim=16,
        index_topk_blocks=2,
    ),
}
MLPS = ("moe", "dense")


def bench_target_config(
    scale: str = "full", max_position_embeddings: int = 2048, mlp: str = "moe"
) -> MiniMaxM3Config:
    """The benchmark target (see the module docstring); ``mlp="dense"``: every MLP dense."""
    if mlp not in MLPS:
        raise ValueError(f"mlp={mlp!r}: expected one of {MLPS}")
    num_layers = NUM_LAYERS[scale]
    sparse = range(NUM_FULL_LAYERS, num_layers)
    layer_types = [
        "minimax_m3_sparse" if i in sparse else "full_attention" for i in range(num_layers)
    ]
    moe = "sparse" if mlp == "moe" else "dense"
    mlp_layer_types = [moe if i in sparse else "dense" for i in range(num_layers)]
    return MiniMaxM3Config.from_dict(
        {
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "dtype": "bfloat16",
            "text_config": {
                **_WIDTHS["full" if scale == "m3-slice" else scale],
                "num_local_experts": NUM_EXPERTS[scale],
                "num_hidden_layers": num_layers,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 5e6,
                    "partial_rotary_factor": 0.5,
                },
                "layer_types": layer_types,
                "mlp_layer_types": mlp_layer_types,
                "index_block_size": 128,
                "index_local_blocks": 1,
                "max_position_embeddings": max_position_embeddings,
                "num_mtp_modules": 1,  # (as published; built only under MTP)
                "bos_token_id": None,
                "eos_token_id": None,
            },
        }
    )


def bench_eagle3_config(target: MiniMaxM3Config) -> Eagle3Config:
    """A drafter of the target's attention geometry and widths, capturing layers 1, L/2, L - 1
    (1, 4, 7 of 8)."""
    n = target.num_hidden_layers
    return Eagle3Config.from_dict(
        {
            "hidden_size": target.hidden_size,
            "intermediate_size": target.dense_intermediate_size,
            "num_attention_heads": target.num_attention_heads,
            "num_key_value_heads": target.num_key_value_heads,
            "head_dim": target.head_dim,
            "vocab_size": target.vocab_size,
            "draft_vocab_size": target.vocab_size,
            "target_hidden_size": target.hidden_size,
            "max_position_embeddings": target.max_position_embeddings,
            "eagle3_layers_to_capture": [1, n // 2, n - 1],
        }
    )


def write_dummy_checkpoints(
    root: Path, scale: str, mlp: str = "moe", max_positions: int = 2048
) -> tuple[Path, Path]:
    """The benchmark target of ``scale`` and its drafter as checkpoints of configs only, for
    ``load_format="dummy"`` (the LLM makes random weights on the device), under ``root``;
    the target with a character tokenizer padded to its vocabulary (every id a model of random
    weights emits decodes to text) and the plain chat template (short prompts, as the earlier
    figures had), so that a server can run it. Returns the target's and the drafter's folders."""
    target = bench_target_config(scale, max_positions, mlp)
    folders = []
    for config, name in ((target, "target"), (bench_eagle3_config(target), "eagle3")):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(config.to_dict()))
        folders.append(root / name)
    tokenizer = build_char_tokenizer(CHAT_ALPHABET, CHAT_SPECIAL_TOKENS, target.vocab_size)
    tokenizer.save(str(folders[0] / TOKENIZER_FILE))
    (folders[0] / TOKENIZER_CONFIG).write_text(json.dumps(plain_tokenizer_config()))
    return folders[0], folders[1]


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


def sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, num_bytes: int, repeats: int = 10) -> float:
    """Bytes moved per second (read + written) by a device-to-device ``copy_`` of ``num_bytes``."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    samples = []
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        samples.append(time.perf_counter() - start)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * num_bytes / statistics.median(samples)


def graphed(fn, *args):
    """``fn(*args)`` captured in a CUDA graph (after two eager runs on a side stream, which compile
    the kernels); returns its replay. Timing a replay measures the device's work without the
    host's launch cost, as the engine's CUDA-graph steps run."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return graph.replay


def time_us(fn, iters: int) -> float:
    """Median per-call time of ``fn`` over ``iters`` calls, in microseconds (CUDA events)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(samples)[len(samples) // 2]


def parallel_options(layout: str) -> dict:
    """The ``LLM`` options of a layout name: ``tp<N>`` (tensor parallel), ``adp<N>`` (attention
    DP), each optionally ``-ep<M>`` (the experts split over M ranks, ``moe_expert_parallel_size``;
    the rest of the N ranks split each expert: ``moe_tensor_parallel_size``)."""
    match = re.fullmatch(r"(tp|adp)([1-9][0-9]*)(?:-ep([1-9][0-9]*))?", layout)
    if match is None:
        raise ValueError(f"layout {layout!r}: expected tp<N>, adp<N>, tp<N>-ep<M> or adp<N>-ep<M>")
    kind, ranks, ep = match.groups()
    options = {"tensor_parallel_size": int(ranks), "enable_attention_dp": kind == "adp"}
    if ep is not None:
        options["moe_expert_parallel_size"] = int(ep)
    return options


def streamed_chat_bodies(num_requests: int, output_len: int) -> list[dict]:
    """The README workload as streamed chat request bodies: gsm8k-style questions, greedy,
    ``output_len`` tokens each (``ignore_eos``), the usage at the end (the tokens counted, not
    the chunks)."""
    from tensorrt_llm.bench.serving import Workload

    extra = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    extra["stream_options"] = {"include_usage": True}
    workload = Workload("gsm8k", num_requests, output_len=output_len)
    return [{**body, **extra} for body in workload.requests()]
