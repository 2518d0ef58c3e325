"""Decode step cost of the M3-shaped model: target only, Eagle3 and MTP (unified and separate).

Builds the M3-shaped random model and its random Eagle3 drafter from a seed (``bench_common.py``),
writes them with a character tokenizer into a temporary directory, then for each mode and batch
size makes an ``LLM`` (``max_batch_size`` = batch, a KV pool sized for the batch), warms it up with
``LLM.generate`` on short prompts, and times ``batch`` prompts of random token ids (fixed seed)
decoded greedily with ``ignore_eos`` by driving ``llm.executor`` itself: the requests are enqueued
as ``LLM.generate`` does and every ``executor.step()`` is timed (``torch.cuda.synchronize()`` on
both sides on CUDA).

- prefill: the steps until every request has its first token (mixed steps included);
- decode step: mean wall time of the steps after that in which every request is still running
  (requests prefilled early finish early; the steps after the first one finished run a smaller
  batch); tokens/s = tokens made by all the steps after the prefill / their time;
- AL: ``executor.stats.avg_decoded_tokens_per_iter`` over the timed run (a random drafter's is
  about 1, so the Eagle3 rows measure the cost of one speculative iteration);
- floor: the bytes a full-batch decode step must read (``StepReads``: the target's weights but its
  embedding, of which a step reads a row per token; of the experts, only those the step's routing
  chose, counted from that routing on every step; the drafter's own weights once per draft pass;
  the KV cache of every running sequence) / the copy bandwidth measured in the same run (a
  device-to-device ``copy_``, counted as bytes read + bytes written).

``--scale m3-slice`` measures a slice of the published config at its full width, 128 experts
included (``bench_common.py``), built in device memory from its configs (``load_format="dummy"``:
no checkpoint file); ``--quant fp8`` runs it (or any scale) in FP8 block scales, and
``--quant none,fp8`` runs both in one run, with the FP8 / ``--dtype`` step ratio in the summary.

``--max-seconds`` caps each cell's decode loop (the remaining requests are cancelled and the step
count shows it), so the default GPU run (3 modes x batches 1, 16, 64) stays within minutes.

    python benchmarks/bench_decode.py [--device cuda] [--batches 1,16,64] \\
        [--modes target,unified,separate] [--prompt-len 1024] [--new-tokens 64] [--json PATH]
    python benchmarks/bench_decode.py --device cuda --mlp dense --load-format dummy --modes target,guided
    python benchmarks/bench_decode.py --scale m3-slice --device cuda [--quant none,fp8]
    python benchmarks/bench_decode.py --scale tiny --device cpu --batches 1,2 --new-tokens 4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import (
    MLPS,
    bench_eagle3_config,
    bench_target_config,
    copy_bandwidth,
    machine_name,
    parallel_options,
    sync_device,
)
from reference_decoder import ReferenceDecoder

from tensorrt_llm import LLM, GuidedDecodingParams, SamplingParams
from tensorrt_llm._torch.models.checkpoint import random_eagle3, random_model, save_pretrained
from tensorrt_llm._torch.modules.moe import MiniMaxM3SparseMoeBlock
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm._torch.speculative.utils import SEPARATE_MODE, VIEW_MODE, WHOLE_PAGE_MODE
from tensorrt_llm.llmapi import Eagle3DecodingConfig, KvCacheConfig, MTPDecodingConfig, QuantConfig
from tensorrt_llm.llmapi.llm_args import CudaGraphConfig, default_attn_backend
from tensorrt_llm.logger import logger
from tensorrt_llm.tokenizer import (
    M3_ALPHABET,
    M3_SPECIAL_TOKENS,
    M3_TEXT_TOKENS,
    build_char_tokenizer,
)

MODES = (
    "target", "sampled", "guided", "unified", "separate", "mtp", "mtp-separate", "reference"
)  # fmt: skip
# the engine's modes: target only (greedy, sampled, or greedy under a JSON schema) and Eagle3;
# "reference" is not the engine
ENGINE_MODES = MODES[:-1]
DRAFT_KV_MODES = {
    "unified": VIEW_MODE,
    "separate": SEPARATE_MODE,
    "mtp": WHOLE_PAGE_MODE,  # (the module's layer in the target's slots)
    "mtp-separate": SEPARATE_MODE,
}
# per scale: prompt tokens, new tokens, copy MiB on CUDA, copy MiB on the CPU
SCALE_DEFAULTS = {
    "full": (1024, 64, 2048, 512),
    "m3-slice": (1024, 64, 2048, 512),
    "tiny": (160, 8, 2048, 64),
}
WARMUP_NEW_TOKENS = 8
WAITING = LlmRequestState.WAITING_FOR_GRAMMAR  # (the warm-up compiled the schema: one step)
GUIDED_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40}}},
    "required": ["notes"],
}


@dataclasses.dataclass(frozen=True)
class Settings:
    scale: str
    device: str
    dtype: str
    attn_backend: str
    cuda_graphs: bool
    prompt_len: int
    new_tokens: int
    max_draft_len: int
    max_num_tokens: int
    max_seconds: float
    seed: int
    parallel: str = "tp1"  # the ranks' layout (bench_multi_gpu.py: ``parallel_options``)
    mlp: str = "moe"  # "dense": the all-dense variant of the benchmark model
    load_format: str = "auto"  # "dummy": configs only, random weights made on the device
    quant: str | None = None  # "fp8": FP8 block scales (QuantConfig FP8_BLOCK_SCALES); a run
    # of both formats records "none,fp8" here and runs each cell with its own
    overlap: bool = True  # the overlap scheduler (the LLM's default)


@dataclasses.dataclass
class Cell:
    """One mode at one batch size."""

    mode: str
    batch: int
    weights: str  # --dtype, or "fp8" (FP8 block scales)
    setup_s: float  # LLM construction and warm-up
    prefill_s: float
    num_prefill_steps: int
    num_decode_steps: int
    decode_step_ms: float
    decode_tokens_per_s: float
    al: float | None
    graph_steps: int  # timed steps replayed from a CUDA graph
    step_bytes: float  # what a full-batch decode step must read, on average (StepReads)
    experts_hit: float  # per MoE layer and step, on average
    truncated: bool  # --max-seconds cut the decode loop

    def floor_ms(self, bandwidth: float) -> float:
        return self.step_bytes / bandwidth * 1e3


def write_checkpoints(root: Path, s: Settings) -> tuple[Path, Path]:
    """The seeded random target (with a character tokenizer) and drafter, saved in bf16; only
    their configs under ``load_format="dummy"`` (the LLM makes the weights on the device)."""
    max_positions = max(2048, s.prompt_len + s.new_tokens)
    target_config = bench_target_config(s.scale, max_positions, s.mlp)
    draft_config = bench_eagle3_config(target_config)
    # M3's characters (JSON among them), filled to the model's vocabulary with tokens of their own
    # text: a grammar's mask weighs every one, as a real vocabulary's would be
    tokenizer = build_char_tokenizer(
        M3_ALPHABET, M3_SPECIAL_TOKENS, target_config.vocab_size, text_tokens=M3_TEXT_TOKENS
    )
    if s.load_format == "dummy":
        for config, name in ((target_config, "target"), (draft_config, "eagle3")):
            (root / name).mkdir(parents=True)
            (root / name / "config.json").write_text(json.dumps(config.to_dict()))
    else:
        target = random_model(target_config, seed=s.seed, num_mtp_modules=1).to(torch.bfloat16)
        save_pretrained(target, target_config, root / "target")
        del target
        drafter = random_eagle3(draft_config, target_config.num_hidden_layers, seed=s.seed + 1)
        save_pretrained(drafter.to(torch.bfloat16), draft_config, root / "eagle3")
    tokenizer.save(str(root / "target" / "tokenizer.json"))
    return root / "target", root / "eagle3"


def speculative_config(mode: str, draft_dir: Path, s: Settings):
    """The mode's drafter: Eagle3's (``unified``, ``separate``), the target's MTP module's
    (``mtp``, ``mtp-separate``), or None."""
    if mode in ("mtp", "mtp-separate"):
        kv = "separate" if mode == "mtp-separate" else "unified"
        return MTPDecodingConfig(max_draft_len=s.max_draft_len, draft_kv_cache=kv)
    if mode in DRAFT_KV_MODES:
        return Eagle3DecodingConfig(
            max_draft_len=s.max_draft_len, speculative_model=str(draft_dir), draft_kv_cache=mode
        )
    return None


def make_llm(target_dir: Path, draft_dir: Path, mode: str, batch: int, s: Settings) -> LLM:
    spec = speculative_config(mode, draft_dir, s)
    # room for every request to finish: prompt + generation + the speculative extra positions
    blocks_per_request = math.ceil((s.prompt_len + s.new_tokens + 2 * s.max_draft_len) / 128)
    max_seq_len = s.prompt_len + s.new_tokens
    return LLM(
        target_dir,
        kv_cache_config=KvCacheConfig(
            max_tokens=(batch * blocks_per_request + padding_blocks(batch, max_seq_len, s)) * 128
        ),
        max_batch_size=batch,
        max_num_tokens=s.max_num_tokens,
        max_seq_len=max_seq_len,
        dtype=s.dtype,
        device=s.device,
        attn_backend=s.attn_backend,
        speculative_config=spec,
        guided_decoding_backend="xgrammar" if mode == "guided" else None,
        disable_overlap_scheduler=not s.overlap,
        **parallel_options(s.parallel),
        load_format=s.load_format,
        quant_config=QuantConfig(quant_algo="FP8_BLOCK_SCALES") if s.quant == "fp8" else None,
        **({} if s.cuda_graphs else {"cuda_graph_config": None}),
    )


def padding_blocks(batch: int, max_seq_len: int, s: Settings) -> int:
    """The slots the CUDA graphs' padding sequence holds: a padded row's step and draft chain, or
    the largest mixed graph's padding tokens (the LLM's default ``cuda_graph_config``)."""
    if not s.cuda_graphs or s.device != "cuda":
        return 0
    options = CudaGraphConfig().to_runtime(batch, max_seq_len)
    tokens = max(2 * (1 + s.max_draft_len), options.mixed_prompt_tokens * options.max_prompts)
    return math.ceil(tokens / 128)


class StepReads:
    """The bytes a decode step must read (the module docstring's floor). Each MoE layer records the
    experts its routing chose (``expert_hits``, set before the first step so the CUDA graphs
    capture the recording); ``clear`` before a step, ``bytes`` after it."""

    def __init__(self, llm: LLM, max_draft_len: int) -> None:
        model = llm.model
        self.blocks = [m for m in model.modules() if isinstance(m, MiniMaxM3SparseMoeBlock)]
        experts = [b.experts for b in self.blocks]
        expert_tensors = {id(t) for e in experts for t in (*e.parameters(), *e.buffers())}
        embedding = model.model.embed_tokens.weight
        worker = llm.executor.spec_worker
        own = {}
        if worker is not None:  # its own weights (an MTP module's are the model's), per draft pass
            own = {id(t): t for t in worker.draft_model.parameters() if t is not embedding}
        skip = expert_tensors | {id(embedding)} | set(own)
        target = {id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) not in skip}
        self.fixed = _nbytes(target.values()) + max_draft_len * _nbytes(own.values())
        self.per_expert = [
            _nbytes(t for t in (*e.parameters(), *e.buffers())) / e.num_experts for e in experts
        ]
        for block in self.blocks:
            block.expert_hits = torch.zeros(
                block.experts.num_global_experts, dtype=torch.bool, device=embedding.device
            )
        managers = llm.executor.resource_manager.kv_cache_managers.values()
        self.kv_per_token = sum(
            sum(pool.slot_bytes for pool in m.layout.pools) / m.tokens_per_block
            for m in managers
            if isinstance(m, KVCacheManagerV2)
        )

    def clear(self) -> None:
        for block in self.blocks:
            block.expert_hits.zero_()

    def bytes(self, requests: list[LlmRequest]) -> tuple[float, float]:
        """The last step's bytes, and its experts hit per MoE layer."""
        hits = [int(b.expert_hits.sum()) for b in self.blocks]
        running = [r for r in requests if not r.is_finished]
        tokens = sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in running)
        experts = sum(n * size for n, size in zip(hits, self.per_expert, strict=True))
        per_layer = sum(hits) / len(hits) if hits else 0.0
        return self.fixed + experts + tokens * self.kv_per_token, per_layer


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator).tolist()


def mode_params(mode: str, s: Settings) -> SamplingParams:
    """Greedy, but for ``sampled``: temperature 0.8, top-p 0.9, seeded, with each token's logprob
    (what a chat client asks for); for ``guided``: under ``GUIDED_SCHEMA`` (a list of strings that
    never ends within the benchmark's tokens)."""
    if mode == "sampled":
        return SamplingParams(
            max_tokens=s.new_tokens,
            ignore_eos=True,
            temperature=0.8,
            top_p=0.9,
            seed=s.seed,
            logprobs=1,
            detokenize=False,
        )
    guide = GuidedDecodingParams(json=GUIDED_SCHEMA) if mode == "guided" else None
    return SamplingParams(
        max_tokens=s.new_tokens,
        ignore_eos=True,
        temperature=0,
        detokenize=False,
        guided_decoding=guide,
    )


def timed_run(
    llm: LLM, prompts: list[list[int]], s: Settings, reads: StepReads, params: SamplingParams
) -> dict:
    """Enqueue the prompts as ``LLM.generate`` does and time each ``executor.step()``. With the
    overlap scheduler a step's call returns before the device finishes it, so the device is
    synchronized only around the loop; a step's time is then from one call's start to the next's
    (in the steady state, the device's time per step). The routing of the MoE layers is read
    only without the overlap (reading it waits for the device): with it, no floor."""
    executor = llm.executor
    requests = [  # ids clear of the ones LLM.generate hands out
        LlmRequest(
            request_id=10**9 + i,
            prompt_token_ids=prompt,
            max_new_tokens=s.new_tokens,
            sampling_params=params,
            end_ids=llm.eos_token_ids,
        )
        for i, prompt in enumerate(prompts)
    ]
    before = dataclasses.replace(executor.stats)
    runner = getattr(executor, "local", executor).cuda_graph_runner  # attention DP: rank 0's
    replays_before = runner.num_replays if runner is not None else 0
    for request in requests:
        executor.enqueue_request(request)
    sync_device(s.device)
    start = time.perf_counter()
    num_prefill_steps = 0
    # until every prompt's last chunk is launched (with the overlap, its token is read in the
    # next call, which launches the first decode step)
    while any(r.is_context_init_state or r.state is WAITING for r in requests):
        # (under attention DP another rank's progress shows in its reported tokens)
        before_step = executor.stats.num_steps, sum(len(r.output_token_ids) for r in requests)
        executor.step()
        after_step = executor.stats.num_steps, sum(len(r.output_token_ids) for r in requests)
        if after_step == before_step:
            raise RuntimeError("the executor scheduled nothing: the KV pool is too small")
        num_prefill_steps += 1
    sync_device(s.device)
    prefill_s = time.perf_counter() - start
    step_s: list[float] = []
    full_batch_s: list[float] = []  # steps in which every request was still running
    full_batch_reads: list[tuple[float, float]] = []  # their bytes and experts hit per layer
    truncated = False
    measure_reads = not (s.overlap and reads.blocks)
    steps_before_decode = executor.stats.num_steps
    start = time.perf_counter()
    while executor.has_work:
        if sum(step_s) > s.max_seconds:
            truncated = True
            for request in requests:
                executor.cancel_request(request.request_id)
            break
        full = not any(r.is_finished for r in requests)
        if measure_reads:
            reads.clear()
        executor.step()
        if not s.overlap or not executor.has_work:
            sync_device(s.device)
        now = time.perf_counter()
        step_s.append(now - start)
        start = now
        # (with the overlap, the first call launches the first decode step onto an idle device
        # and reads the prefill's: its time is the host's alone)
        if full and (len(step_s) > 1 or not s.overlap):
            full_batch_s.append(step_s[-1])
            if measure_reads:
                full_batch_reads.append(reads.bytes(requests))
    after = executor.stats
    iterations = after.num_decode_iterations - before.num_decode_iterations
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    # every token but each prompt's first (the prefill's)
    decode_tokens = sum(len(r.output_token_ids) for r in requests) - len(requests)
    return {
        "prefill_s": prefill_s,
        "num_prefill_steps": num_prefill_steps,
        "num_decode_steps": executor.stats.num_steps - steps_before_decode,  # launched
        "decode_step_ms": statistics.fmean(full_batch_s or step_s or [math.nan]) * 1e3,
        "decode_tokens_per_s": decode_tokens / sum(step_s) if step_s else math.nan,
        "al": 1 + accepted / iterations if iterations else None,
        "graph_steps": (runner.num_replays if runner is not None else 0) - replays_before,
        "step_bytes": statistics.fmean(b for b, _ in full_batch_reads or [(math.nan, 0)]),
        "experts_hit": statistics.fmean(h for _, h in full_batch_reads or [(math.nan, math.nan)]),
        "truncated": truncated,
    }


def run_reference(batch: int, s: Settings) -> Cell:
    """The plain-PyTorch decoder's row (``reference_decoder.py``): ``new_tokens`` steps replayed
    back to back, timed as a whole."""
    start = time.perf_counter()
    config = bench_target_config(s.scale, max(2048, s.prompt_len + s.new_tokens), s.mlp)
    dtype = getattr(torch, s.dtype)
    decoder = ReferenceDecoder(
        config, batch, s.prompt_len, s.prompt_len + s.new_tokens, s.device, dtype, s.seed
    )
    try:
        decoder.prepare()
        sync_device(s.device)
        setup_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(s.new_tokens):
            decoder.step()
        sync_device(s.device)
        elapsed = time.perf_counter() - start
    finally:
        del decoder
        gc.collect()
        if s.device == "cuda":
            torch.cuda.empty_cache()
    return Cell(
        "reference", batch, s.dtype, setup_s, 0.0, 0, s.new_tokens, elapsed / s.new_tokens * 1e3,
        batch * s.new_tokens / elapsed, None, s.new_tokens if s.device == "cuda" else 0,
        math.nan, 0.0, False,
    )  # fmt: skip


def run_cell(target_dir: Path, draft_dir: Path, mode: str, batch: int, s: Settings) -> Cell:
    if mode == "reference":
        return run_reference(batch, s)
    start = time.perf_counter()
    llm = make_llm(target_dir, draft_dir, mode, batch, s)
    try:
        reads = StepReads(llm, s.max_draft_len)  # before the warm-up captures the graphs
        vocab = llm.model_config.vocab_size
        # the measured shapes (prompt length, decode lengths), so kernels are compiled before timing
        warmup = random_prompts(batch, s.prompt_len, vocab, s.seed + 7)
        # long enough that the whole batch decodes together after the chunked prefill (so the
        # decode batch's CUDA graph is captured here, not in the timed run)
        prefill_steps = math.ceil(batch * s.prompt_len / s.max_num_tokens)
        warmup_tokens = min(WARMUP_NEW_TOKENS + prefill_steps, s.new_tokens)
        # the mode's own parameters: a sampled batch's graphs are its own
        llm.generate(warmup, dataclasses.replace(mode_params(mode, s), max_tokens=warmup_tokens))
        if (
            mode in DRAFT_KV_MODES
            and llm.executor.spec_worker.draft_kv_mode != DRAFT_KV_MODES[mode]
        ):
            raise RuntimeError(
                f"mode {mode}: the drafter's KV resolved to {llm.executor.spec_worker.draft_kv_mode!r}"
            )
        setup_s = time.perf_counter() - start
        prompts = random_prompts(batch, s.prompt_len, vocab, s.seed)
        guided = getattr(llm.executor, "local", llm.executor).guided  # (attention DP: rank 0)
        filled = guided.fill_seconds if guided is not None else 0.0
        result = timed_run(llm, prompts, s, reads, mode_params(mode, s))
        if guided is not None:  # the host's share, done while the step's forward runs
            per_step = (guided.fill_seconds - filled) / max(result["num_decode_steps"], 1)
            print(
                f"{mode} batch {batch}: the host fills the grammars' masks in "
                f"{per_step * 1e3:.2f} ms a step, while the step's forward runs (the step: "
                f"{result['decode_step_ms']:.2f} ms)",
                file=sys.stderr,
                flush=True,
            )
        return Cell(mode, batch, s.quant or s.dtype, setup_s, **result)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if s.device == "cuda":
            torch.cuda.empty_cache()


def weights_names(cells: list[Cell]) -> str:
    names = {"fp8": "FP8 block scales"}
    return " and ".join(dict.fromkeys(names.get(c.weights, c.weights) for c in cells))


def print_report(cells: list[Cell], s: Settings, machine: str, bandwidth: float) -> None:
    print(
        f"decode step cost, random published-M3 model ({s.scale}, {s.mlp} MLPs, weights "
        f"{weights_names(cells)}, load_format={s.load_format}), attn_backend="
        f"{s.attn_backend}, cuda graphs {'on' if s.cuda_graphs else 'off'}, overlap scheduler {'on' if s.overlap else 'off'}, prompt {s.prompt_len} + {s.new_tokens} new tokens, "
        f"max_draft_len={s.max_draft_len}, max_num_tokens={s.max_num_tokens}"
    )
    print(f"machine: {machine}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written)")
    print(
        f"{'mode':<12} {'batch':>5} {'weights':>8} {'setup s':>7} {'prefill s':>9} {'steps':>5} "
        f"{'decode steps':>12} {'graphed':>7} {'step ms':>9} {'tokens/s':>9} {'AL':>5} "
        f"{'experts hit':>11} {'floor ms':>8} {'step / floor':>12}"
    )
    for c in cells:
        al = "-" if c.al is None else f"{c.al:.2f}"
        steps = f"{c.num_decode_steps}{'*' if c.truncated else ''}"
        floor = c.floor_ms(bandwidth)
        print(
            f"{c.mode:<12} {c.batch:>5} {c.weights:>8} {c.setup_s:>7.1f} {c.prefill_s:>9.2f} "
            f"{c.num_prefill_steps:>5} {steps:>12} {c.graph_steps:>7} {c.decode_step_ms:>9.2f} "
            f"{c.decode_tokens_per_s:>9.1f} {al:>5} {c.experts_hit:>11.1f} {floor:>8.3f} "
            f"{c.decode_step_ms / floor:>12.2f}"
        )
    if any(c.truncated for c in cells):
        print(
            f"* decode loop cut by --max-seconds={s.max_seconds:g}; the step time is the mean so far"
        )
    for line in summary(cells, bandwidth):
        print(line)


def summary(cells: list[Cell], bandwidth: float) -> list[str]:
    """The ratios the benchmark is for, where the run has the cells they need (per weights
    format), then FP8 over the other format."""
    formats = list(dict.fromkeys(c.weights for c in cells))
    lines = []
    for weights in formats:
        if len(formats) > 1:
            lines.append(f"{weights}:")
        lines += summary_of_one_format([c for c in cells if c.weights == weights], bandwidth)
    if "fp8" in formats and len(formats) == 2:
        other = next(w for w in formats if w != "fp8")
        at = {(c.mode, c.batch, c.weights): c for c in cells}
        for mode, batch in dict.fromkeys((c.mode, c.batch) for c in cells):
            if (fp8 := at.get((mode, batch, "fp8"))) and (base := at.get((mode, batch, other))):
                lines.append(
                    f"{mode} batch {batch}: fp8 / {other} step = "
                    f"{fp8.decode_step_ms / base.decode_step_ms:.2f} "
                    f"(their floors: {fp8.step_bytes / base.step_bytes:.2f})"
                )
    return lines


def summary_of_one_format(cells: list[Cell], bandwidth: float) -> list[str]:
    at = {(c.mode, c.batch): c for c in cells}
    batches = sorted({c.batch for c in cells})
    small, large = batches[0], batches[-1]
    lines = []
    if (base := at.get(("target", 1))) is not None:
        lines.append(
            f"batch-1 target-only decode step / floor (bytes it must read): {base.decode_step_ms:.2f} ms / "
            f"{base.floor_ms(bandwidth):.3f} ms = {base.decode_step_ms / base.floor_ms(bandwidth):.1f}"
        )
    for mode in MODES:
        if large != small and (mode, small) in at and (mode, large) in at:
            ratio = at[mode, large].decode_step_ms / at[mode, small].decode_step_ms
            lines.append(f"{mode}: batch-{large} step / batch-{small} step = {ratio:.2f}")
    for batch in batches:
        if ("target", batch) in at and ("reference", batch) in at:
            ratio = at["target", batch].decode_step_ms / at["reference", batch].decode_step_ms
            lines.append(f"batch {batch}: target-only step / plain-PyTorch reference = {ratio:.2f}")
        if ("target", batch) in at and ("sampled", batch) in at:
            ratio = at["sampled", batch].decode_step_ms / at["target", batch].decode_step_ms
            lines.append(f"batch {batch}: sampled (with logprobs) / greedy step = {ratio:.2f}")
        if ("target", batch) in at and ("guided", batch) in at:
            ratio = at["guided", batch].decode_step_ms / at["target", batch].decode_step_ms
            lines.append(f"batch {batch}: guided (JSON schema) / greedy step = {ratio:.2f}")
        for name, unified, separate in (
            ("Eagle3", "unified", "separate"),
            ("MTP", "mtp", "mtp-separate"),
        ):
            if (unified, batch) in at and (separate, batch) in at:
                ratio = at[unified, batch].decode_step_ms / at[separate, batch].decode_step_ms
                lines.append(
                    f"batch {batch}: {name} unified / separate per-iteration cost = {ratio:.3f}"
                )
        if ("target", batch) in at and ("mtp", batch) in at:
            ratio = at["mtp", batch].decode_step_ms / at["target", batch].decode_step_ms
            lines.append(f"batch {batch}: MTP iteration / target-only step = {ratio:.2f}")
    for mode in ENGINE_MODES:
        if (mode, large) in at:
            lines.append(f"{mode}: prefill of {large} prompts = {at[mode, large].prefill_s:.2f} s")
    return lines


def parse_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--attn-backend",
        choices=["VANILLA", "TRITON"],
        help="default: the LLM's (TRITON on CUDA, VANILLA on the CPU)",
    )
    parser.add_argument(
        "--cuda-graphs",
        default="on",
        choices=["on", "off"],
        help="decode steps from CUDA graphs (on: the LLM's default, which runs them where it can: "
        "CUDA with TRITON)",
    )
    parser.add_argument("--scale", default="full", choices=sorted(SCALE_DEFAULTS))
    parser.add_argument(
        "--mlp", default="moe", choices=MLPS, help="dense: every MLP dense (bench_common.py)"
    )
    parser.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        help="dummy: configs only, weights made on the device (the default for m3-slice)",
    )
    parser.add_argument(
        "--quant",
        default="none",
        help="comma-separated, of none (--dtype) and fp8 (FP8 block scales); both: one run each",
    )
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument(
        "--modes",
        help=f"comma-separated, of {MODES} (default: all; reference only with --mlp dense)",
    )
    parser.add_argument(
        "--overlap",
        default="on",
        choices=["on", "off"],
        help="the overlap scheduler (on: the LLM's default; off: disable_overlap_scheduler)",
    )
    parser.add_argument("--prompt-len", type=int, help="default 1024 (tiny: 160)")
    parser.add_argument("--new-tokens", type=int, help="default 64 (tiny: 8)")
    parser.add_argument("--max-draft-len", type=int, default=3)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-seconds", type=float, default=25.0, help="decode time cap per cell")
    parser.add_argument("--copy-mib", type=int, help="copy size for the bandwidth (2048 on CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    args.modes = (
        args.modes.split(",")
        if args.modes
        else [m for m in MODES if m != "guided" and (m != "reference" or args.mlp == "dense")]
    )
    if "reference" in args.modes and args.mlp != "dense":
        parser.error("--modes reference: the plain-PyTorch reference is dense; add --mlp dense")
    args.quant = list(dict.fromkeys(args.quant.split(",")))
    if unknown := sorted(set(args.quant) - {"none", "fp8"}):
        parser.error(f"--quant: unknown format(s) {unknown}; expected some of ['none', 'fp8']")
    if unknown := sorted(set(args.modes) - set(MODES)):
        parser.error(f"--modes: unknown mode(s) {unknown}; expected some of {MODES}")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches={args.batches!r}: expected comma-separated integers")
    prompt_len, new_tokens, copy_cuda, copy_cpu = SCALE_DEFAULTS[args.scale]
    if args.copy_mib is None:
        args.copy_mib = copy_cuda if args.device == "cuda" else copy_cpu
    settings = Settings(
        scale=args.scale,
        device=args.device,
        dtype=args.dtype,
        attn_backend=args.attn_backend or default_attn_backend(args.device),
        cuda_graphs=args.cuda_graphs == "on"
        and args.device == "cuda"
        and (args.attn_backend or default_attn_backend(args.device)) == "TRITON",
        prompt_len=prompt_len if args.prompt_len is None else args.prompt_len,
        new_tokens=new_tokens if args.new_tokens is None else args.new_tokens,
        max_draft_len=args.max_draft_len,
        max_num_tokens=args.max_num_tokens,
        max_seconds=args.max_seconds,
        seed=args.seed,
        mlp=args.mlp,
        overlap=args.overlap == "on",
        load_format=args.load_format or ("dummy" if args.scale == "m3-slice" else "auto"),
        quant=None if args.quant == ["none"] else ",".join(args.quant),
    )
    return settings, args


def write_json(path: Path, machine: str, s: Settings, bandwidth: float, cells: list[Cell]) -> None:
    record = {
        "machine": machine,
        "settings": dataclasses.asdict(s),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "cells": [{**dataclasses.asdict(c), "floor_ms": c.floor_ms(bandwidth)} for c in cells],
        "summary": summary(cells, bandwidth),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> list[Cell]:
    s, args = parse_args(argv)
    logger.set_level("warning")
    torch.manual_seed(s.seed)
    machine = machine_name(s.device)
    bandwidth = copy_bandwidth(s.device, args.copy_mib * 2**20)
    started = time.perf_counter()
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        target_dir, draft_dir = write_checkpoints(Path(tmp), s)
        for batch in args.batches:
            for mode in args.modes:
                for quant in args.quant if mode != "reference" else ["none"]:
                    cell_settings = dataclasses.replace(s, quant=None if quant == "none" else quant)
                    cell = run_cell(target_dir, draft_dir, mode, batch, cell_settings)
                    cells.append(cell)
                    print(  # progress, so a cut-short run still shows what it measured
                        f"[{time.perf_counter() - started:6.1f} s] {mode} batch {batch} "
                        f"{cell.weights}: prefill {cell.prefill_s:.2f} s, "
                        f"step {cell.decode_step_ms:.2f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
                    if args.json is not None:
                        write_json(args.json, machine, s, bandwidth, cells)
    cells.sort(key=lambda c: (c.weights == "fp8", MODES.index(c.mode), c.batch))
    print_report(cells, s, machine, bandwidth)
    print(f"total {time.perf_counter() - started:.1f} s")
    return cells


if __name__ == "__main__":
    main()
