"""The benchmark scripts: the KV capacity arithmetic on real slot layouts, and a decode smoke run."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import (  # noqa: E402
    bench_eagle3_config,
    bench_target_config,
    bundled_configs,
    write_dummy_checkpoints,
)
from bench_kv_capacity import measure  # noqa: E402

GIB = 2**30


def capacities(target, draft, budget=16 * GIB):
    return {
        mode: measure("m", (target, draft), mode, budget, request_tokens=8192, max_draft_len=3)
        for mode in ("target only", "eagle3 separate", "eagle3 unified")
    }


def test_bundled_unified_slot_is_the_target_and_draft_buffers_plus_reported_padding():
    cap = capacities(*bundled_configs())
    unified, separate = cap["eagle3 unified"], cap["eagle3 separate"]
    # one unified slot holds exactly the buffers of the separate target slot and draft slot
    assert unified.used_bytes == (sum(separate.used_bytes),)
    assert unified.slot_bytes[0] == unified.used_bytes[0] + unified.padding_bytes
    # m3-tiny, bf16, 128-token blocks: 4 layers of 2x64 K and V, index-K 1x32 on the sparse layers
    # 1 and 3; the drafter's K and V of 4x64; whole 32-token kernel pages of the draft buffers,
    # with no padding needed
    assert separate.slot_bytes == (278528, 131072)
    assert unified.slot_bytes == (409600,)
    assert unified.padding_bytes == separate.padding_bytes == 0
    assert cap["target only"].slot_bytes == (278528,)


def test_bundled_unified_fits_as_many_tokens_as_separate_and_fewer_than_target_only():
    cap = capacities(*bundled_configs())
    unified, separate, target = (
        cap["eagle3 unified"],
        cap["eagle3 separate"],
        cap["target only"],
    )
    assert unified.num_tokens >= separate.num_tokens
    assert unified.num_tokens == 16 * GIB // 409600 * 128
    assert unified.num_tokens < target.num_tokens
    # an 8192-token request holds 64 blocks, 65 with the speculative extra positions
    assert (target.blocks_per_request, unified.blocks_per_request) == (64, 65)
    assert unified.num_requests == 16 * GIB // 409600 // 65


def test_bench_model_draft_kv_costs_one_more_target_layer_per_block():
    target = bench_target_config()
    cap = capacities(target, bench_eagle3_config(target))
    kv_per_layer = 2 * 128 * 4 * 128 * 2  # K and V: 128 tokens x 4 heads x 128 dims x bf16
    index_k = 128 * 128 * 2  # on the 5 sparse layers only
    assert cap["target only"].slot_bytes == (8 * kv_per_layer + 5 * index_k,)
    assert cap["eagle3 unified"].slot_bytes == (9 * kv_per_layer + 5 * index_k,)
    assert cap["eagle3 separate"].slot_bytes == (8 * kv_per_layer + 5 * index_k, kv_per_layer)


@pytest.mark.parametrize("scale", ["full", "tiny"])
def test_the_bench_model_is_the_published_architecture_with_a_dense_variant(scale):
    moe, dense = bench_target_config(scale), bench_target_config(scale, mlp="dense")
    assert moe.sparse_layer_ids == dense.sparse_layer_ids == (3, 4, 5, 6, 7)
    assert moe.moe_layer_ids == (3, 4, 5, 6, 7) and dense.moe_layer_ids == ()
    assert moe.index_n_heads == moe.num_key_value_heads
    if scale == "full":  # the published widths
        widths = (moe.hidden_size, moe.num_attention_heads, moe.head_dim, moe.rotary_dim)
        assert widths == (6144, 64, 128, 64) and moe.vocab_size == 200064
        assert (moe.intermediate_size, moe.dense_intermediate_size) == (3072, 12288)


def run_benchmark(script: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """``benchmarks/<script> args`` in a subprocess; it must exit 0."""
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    # one intra-op thread: on a small shared CPU, more threads than free cores only spin
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_decode_benchmark_runs_end_to_end_at_tiny_scale(tmp_path):
    out = tmp_path / "decode.json"
    args = ["--scale", "tiny", "--device", "cpu", "--batches", "1,2", "--new-tokens", "4"]
    args += ["--mlp", "dense"]  # every mode, the plain-PyTorch reference included
    done = run_benchmark("bench_decode.py", [*args, "--json", str(out)], timeout_s=180)
    assert "step / floor" in done.stdout and "machine:" in done.stdout
    assert "overlap scheduler on" in done.stdout
    record = json.loads(out.read_text())
    cells = {(c["mode"], c["batch"]): c for c in record["cells"]}
    modes = ("mtp", "mtp-separate", "reference", "sampled", "separate", "target", "unified")
    assert sorted(cells) == [(m, b) for m in modes for b in (1, 2)]
    for (mode, _), cell in cells.items():
        assert not cell["truncated"] and cell["decode_step_ms"] > 0
        if mode == "reference":  # 4 steps replayed back to back
            assert cell["num_decode_steps"] == 4 and cell["al"] is None
            continue
        assert cell["num_prefill_steps"] == 1  # 2 x 160 prompt tokens fit one step
        # 4 new tokens: the first from the prefill, then one or more per decode step (none is
        # launched past max_tokens, with the overlap too)
        if mode in ("target", "sampled"):
            assert cell["num_decode_steps"] == 3 and cell["al"] == 1.0
        else:
            assert 1 <= cell["num_decode_steps"] <= 3 and cell["al"] >= 1.0
        # (the MTP module is an MoE: under the overlap its routing is not read, nor the floor)
        assert cell["floor_ms"] > 0 or mode.startswith("mtp") and math.isnan(cell["floor_ms"])
    assert record["copy_bandwidth_bytes_per_s"] > 0
    summary = record["summary"]
    ratios = ("Eagle3 unified / separate", "MTP unified / separate", "MTP iteration / target")
    for ratio in (*ratios, "plain-PyTorch reference", "sampled (with logprobs)"):
        assert sum(ratio in line for line in summary) == 2, ratio


def test_drafters_benchmark_runs_the_bundled_model_with_each_drafter(tmp_path):
    """The bundled target carries its MTP module, so every mode runs; greedy speculation gives
    target only's tokens."""
    out = tmp_path / "drafters.json"
    args = ["--batches", "2", "--num-requests", "2", "--output-len", "24", "--rounds", "1"]
    done = run_benchmark("bench_drafters.py", [*args, "--json", str(out)], timeout_s=240)
    assert "machine:" in done.stdout
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ["eagle3", "mtp", "target"]
    assert rows["target"]["ratio"] == 1.0 and rows["target"]["al"] == 1.0
    for mode in ("eagle3", "mtp"):
        assert rows[mode]["same"] == "2/2" and rows[mode]["al"] > 1.5, mode
        assert rows[mode]["tokens"] == rows["target"]["tokens"] and rows[mode]["tokens_per_s"] > 0


def test_decode_benchmark_builds_dummy_fp8_weights_and_counts_the_experts_hit(tmp_path):
    """The m3-slice path (configs only, weights made on the device, FP8, the step's reads counted
    from its routing) at tiny scale on the CPU."""
    out = tmp_path / "decode.json"
    args = ["--scale", "tiny", "--device", "cpu", "--batches", "2", "--new-tokens", "4"]
    args += ["--modes", "target,unified", "--load-format", "dummy", "--quant", "none,fp8"]
    args += ["--overlap", "off"]  # reading the routing waits for each step
    done = run_benchmark("bench_decode.py", [*args, "--json", str(out)], timeout_s=120)
    assert "bfloat16 and FP8 block scales, load_format=dummy" in done.stdout
    record = json.loads(out.read_text())
    cells = {(c["mode"], c["weights"]) for c in record["cells"]}
    assert cells == {(m, w) for m in ("target", "unified") for w in ("bfloat16", "fp8")}
    assert any(
        line.startswith("target batch 2: fp8 / bfloat16 step = ") for line in record["summary"]
    )
    for cell in record["cells"]:
        # 4 experts, top-2, 2 sequences (x 4 positions with drafts): between 2 and 4 per layer
        assert 2 <= cell["experts_hit"] <= 4
        assert cell["step_bytes"] > 0 and cell["floor_ms"] > 0


def test_long_context_benchmark_prefills_in_chunks_and_counts_the_reads_at_tiny_scale(tmp_path):
    out = tmp_path / "long.json"
    args = ["--scale", "tiny", "--device", "cpu", "--contexts", "256,512"]
    done = run_benchmark(
        "bench_long_context.py", [*args, "--kv-dtypes", "bfloat16", "--json", str(out)], 120
    )
    assert "bw (growth)" in done.stdout and "machine:" in done.stdout
    record = json.loads(out.read_text())
    cells = {c["context"]: c for c in record["cells"]}
    assert sorted(cells) == [256, 512]  # 256 is the base: no 1K row added below it
    for context, cell in cells.items():
        assert cell["skipped"] is None and cell["decode_step_ms"] > 0
        assert cell["num_prefill_steps"] == context // 128  # chunks of max_num_tokens=128
        assert cell["num_decode_steps"] == 7  # 8 new tokens, the first from the prefill
        # the tiny model's slot: 8 layers of K and V (2 heads x 16), index-K (1 x 16) on 5, bf16
        assert cell["slot_bytes_per_token"] == 8 * 2 * 2 * 16 * 2 + 5 * 16 * 2
    # a decode step's reads: K and V of the 3 full layers and index-K of the 5 sparse ones for
    # every cached token, plus K and V of the 2 x 128 selected tokens on the sparse layers
    selected = 256 * 5 * 2 * 2 * 16 * 2
    assert cells[256]["read_bytes"] == 256 * (3 * 2 * 2 * 16 * 2 + 5 * 16 * 2) + selected
    assert cells[512]["read_bytes"] == 512 * (3 * 2 * 2 * 16 * 2 + 5 * 16 * 2) + selected
    assert cells[512]["growth_bytes"] == 256 * (3 * 2 * 2 * 16 * 2 + 5 * 16 * 2)
    assert record["summary"][0].startswith("bfloat16 batch 1: decode step ")


@pytest.mark.gpu
def test_a_512k_prompt_prefills_and_decodes_on_one_gpu_with_an_fp8_kv_cache(tmp_path):
    """Issue 58's long context: the published-width benchmark model (8 layers, dummy weights),
    a 512K-token prompt in chunks of 8192 with CUDA graphs and the overlap scheduler (about two
    minutes on an H100)."""
    out = tmp_path / "long.json"
    args = ["--device", "cuda", "--contexts", "512K", "--kv-dtypes", "fp8", "--new-tokens", "8"]
    run_benchmark("bench_long_context.py", [*args, "--overlap", "on", "--json", str(out)], 540)
    cells = {c["context"]: c for c in json.loads(out.read_text())["cells"]}
    cell = cells[512 * 1024]
    assert cell["skipped"] is None, cell["skipped"]
    assert cell["num_prefill_steps"] == 64 and cell["num_decode_steps"] == 7
    assert cell["graph_steps"] == 7 and cell["decode_step_ms"] > 0
    assert cell["slot_bytes_per_token"] == 9216  # FP8 rows and their scales, aligned


def test_the_published_kv_bytes_per_token_count_each_row_and_its_fp8_scale():
    from bench_long_context import KV_FORMATS, cached_bytes_per_token, published_config

    config = published_config()  # 3 full layers, 57 sparse (one index-K head of 128 each)
    assert config.sparse_layer_ids == tuple(range(3, 60))
    bf16 = 60 * 2 * 4 * 128 * 2 + 57 * 128 * 2
    fp8 = 60 * 2 * 4 * (128 + 4) + 57 * (128 + 4)  # a float32 scale per token and head
    assert cached_bytes_per_token(config, KV_FORMATS["bfloat16"]) == bf16 == 137472
    assert cached_bytes_per_token(config, KV_FORMATS["fp8"]) == fp8 == 70884


def test_decode_kernels_benchmark_times_every_kernel_at_both_kv_dtypes_in_the_interpreter():
    """Every kernel of a full and a sparse layer timed at bf16 and at FP8 KV (two splits, so the
    reductions run too), and the FP8 attentions (the same K/V quantized) close to bf16's."""
    args = ["--device", "cpu", "--shapes", "1x256", "--iters", "1", "--splits", "2"]
    done = run_benchmark("bench_decode_kernels.py", args, timeout_s=120)
    kernels = {
        "full": ["kv write", "paged attention", "split reduce"],
        "sparse": ["kv write", "index-K write", "block scores", "block selection"]
        + ["sparse attention", "split reduce"],
    }
    for layer, names in kernels.items():
        for name in names:
            for dtype in ("bfloat16", "fp8"):
                row = rf"^{layer} +{re.escape(name)} +(\d+|-) +{dtype} +\d+\.\d+ "
                assert re.search(row, done.stdout, re.MULTILINE), (layer, name, dtype)
    # the reads: 256 tokens x 4 KV heads x K and V, rows of 128 bf16 or 128 fp8 + a float32 scale
    assert re.search(r"^full +paged attention +2 +bfloat16 +[\d.]+ +0\.524 ", done.stdout, re.M)
    assert re.search(r"^full +paged attention +2 +fp8 +[\d.]+ +0\.270 ", done.stdout, re.M)
    checks = re.findall(r"output: relative RMS ([\d.]+), within 0\.1", done.stdout)
    assert len(checks) == 2 and all(float(c) > 0 for c in checks)  # quantized, yet close
    steps = [
        line for line in done.stdout.splitlines() if line.startswith("step (3 full + 5 sparse")
    ]
    assert len(steps) == 2  # the step's sum, per KV dtype


@pytest.mark.parametrize("budget_gib", [1, 16])
def test_capacity_table_prints_every_model_and_mode(budget_gib, capsys):
    from bench_kv_capacity import print_table, run

    rows = run(budget_gib, 8192, 3)
    print_table(rows, budget_gib, 8192)
    lines = capsys.readouterr().out.splitlines()
    assert len(rows) == 6
    assert sum("eagle3 unified" in line for line in lines) == 2
    assert all(r.budget_bytes == budget_gib * GIB for r in rows)


def test_multi_gpu_benchmark_runs_end_to_end_on_the_cpu_over_gloo(tmp_path):
    out = tmp_path / "multi.json"
    args = ["--device", "cpu", "--scale", "tiny", "--batches", "2", "--modes", "unified"]
    args += ["--new-tokens", "4", "--agreement-prompts", "1", "--json", str(out)]
    run_benchmark("bench_multi_gpu.py", args, timeout_s=600)
    record = json.loads(out.read_text())
    layouts = ["tp1", "tp2", "tp2-ep2", "adp2-ep2"]
    assert [c["layout"] for c in record["cells"]] == layouts
    assert all(c["decode_step_ms"] > 0 for c in record["cells"])
    for layout in layouts[1:]:  # fp32 on the CPU: the layouts agree on every token
        a = record["agreement"][layout]
        assert a["free_running"] == a["teacher_forced"] == a["layout"] == 1.0, layout
        assert a["logits_relative_rms"] < 1e-5, layout
    summary = record["summary"]
    assert all(any(f"{layout} / tp1 step" in line for line in summary) for layout in layouts[1:])


def test_vision_benchmark_runs_a_tiny_tower_on_the_cpu(capsys):
    from bench_vision import main

    rows = main(["--device", "cpu", "--tiny", "--size", "56", "--images", "1,2", "--iters", "1"])
    assert [row["images"] for row in rows] == [1, 2]
    assert all(row["together_ms"] > 0 and row["apart_ms"] > 0 for row in rows)
    assert "| 2 |" in capsys.readouterr().out


def test_nixl_agent_benchmark_reads_through_both_kinds_of_agent():
    pytest.importorskip("nixl")
    from bench_nixl_agent import main

    record = main(["--reads", "3", "--idle-s", "0.2"])  # the bytes each size moved are checked
    for kind in ("spinning", "waiting"):
        assert record[kind]["read_4k_ms"] > 0 and record[kind]["read_16m_ms"] > 0
    assert record["waiting"]["poll_us"] > 0 == record["spinning"]["poll_us"]


def test_the_published_width_serving_checkpoint_decodes_every_id_and_renders_chats(tmp_path):
    # bench_serving --model-scale full: configs only (dummy weights), a tokenizer covering the
    # published vocabulary, the plain chat template
    from tensorrt_llm._torch.models.configuration_minimaxm3 import MiniMaxM3Config
    from tensorrt_llm.tokenizer import TransformersTokenizer

    target, draft = write_dummy_checkpoints(tmp_path, "full", "dense")
    config = MiniMaxM3Config.from_pretrained(target)
    assert config.vocab_size == 200064 and (draft / "config.json").exists()
    tokenizer = TransformersTokenizer.from_pretrained(target)
    last = config.vocab_size - 1
    assert tokenizer.decode([last]) == f"<#{last}>"  # a random model's ids all show as text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "How many?"}])
    assert tokenizer.decode(tokenizer.encode(chat), skip_special_tokens=False) == chat
