"""One process per rank: building a rank's model and executor, and starting the other ranks.

``LLM`` runs rank 0 in its own process and starts ranks 1..N-1 as child processes (the ``spawn``
start method of ``torch.multiprocessing``; a script that makes a multi-rank ``LLM`` needs the
usual ``if __name__ == "__main__":`` guard). Each child joins ``torch.distributed`` (NCCL on
``cuda:<rank>``, gloo on the CPU), builds its shard of the model and its executor from the same
``TorchLlmArgs``, tells rank 0 it is ready (or why it failed, as text), then follows rank 0's
steps until rank 0 shuts down. Children are daemons: they end with rank 0's process.
"""

from __future__ import annotations

import gc
import os
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from tensorrt_llm._torch.disaggregation.parallel import connect_ranks, in_lockstep
from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
from tensorrt_llm._torch.distributed.communicator import init_distributed, shutdown_distributed
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.executors.data_parallel import ProgressReporter
from tensorrt_llm._torch.executors.ranks import follow
from tensorrt_llm._torch.models.checkpoint import load_config, load_model
from tensorrt_llm._torch.models.registry import ModelConfig
from tensorrt_llm._torch.pyexecutor._util import create_py_executor
from tensorrt_llm._torch.pyexecutor.executor import RankSync
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm.llmapi.llm_args import MTPDecodingConfig, TorchLlmArgs
from tensorrt_llm.logger import logger
from tensorrt_llm.ports import free_port
from tensorrt_llm.tokenizer import TransformersTokenizer

READY_TIMEOUT_S = 900.0  # loading a large checkpoint on a follower


@dataclass
class RankEngine:
    """What one rank runs."""

    config: ModelConfig
    model: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    tokenizer: TransformersTokenizer | None  # None with skip_tokenizer_init
    max_seq_len: int
    executor: PyExecutor
    transceiver: KvCacheTransceiver | None = None  # with cache_transceiver_config


def leave_a_core(device: torch.device, to: str) -> None:
    """On a CPU, intra-op threads for one core fewer than this process may run on, leaving one
    to another thread or process that runs beside the engine's steps (``to`` names it, for the
    log). Two sets of busy threads on the same cores make OpenMP stop spinning between parallel
    regions, and each region of a small model's step then waits for its threads to wake: the
    server's front beside its engine core, or the thread that loaded the model beside the
    ``LLM``'s engine loop (on 2 cores, the bundled model at batch 16 made 650 tokens/s on the
    loop's thread with two threads, 1,700 with one). ``OMP_NUM_THREADS``, where it is set,
    decides instead."""
    if "OMP_NUM_THREADS" in os.environ or device.type != "cpu":
        return
    threads = min(torch.get_num_threads(), max(1, len(os.sched_getaffinity(0)) - 1))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        logger.info("%d intra-op threads (one core left to %s)", threads, to)


def freeze_startup_heap() -> None:
    """Move what a long-running process built at start-up (the model's modules, the graphs'
    buffers, the tokenizer) out of the collector's reach: a full collection then walks only what
    the serving allocates, not the whole start-up heap, so it pauses the steps for far less. For
    processes that serve from here on (the engine core, a follower rank, the server's front),
    never for a caller's own ``LLM``."""
    gc.collect()
    gc.freeze()


def rank_device(device: str, mapping: Mapping) -> torch.device:
    """The device of ``mapping.rank`` for ``TorchLlmArgs.device``: ``cuda:<rank>`` with several
    ranks on CUDA."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        if mapping.world_size > 1:
            visible = torch.cuda.device_count()
            if visible < mapping.world_size:
                raise ValueError(
                    f"tensor_parallel_size={mapping.tp_size} needs {mapping.tp_size} GPUs, "
                    f"{visible} visible"
                )
            return torch.device("cuda", mapping.rank)
    return torch.device(device)


def mtp_options(spec: MTPDecodingConfig) -> dict:
    """``load_model``'s options for the MTP module: built, its weights from the target
    checkpoint's ``mtp.*`` or from a standalone checkpoint (``speculative_model``)."""
    options = {"num_mtp_modules": spec.num_nextn_predict_layers}
    if spec.speculative_model is not None:
        options["mtp_checkpoint"] = spec.speculative_model
    return options


def build_rank(
    args: TorchLlmArgs, mapping: Mapping, rank_sync: RankSync | None = None
) -> RankEngine:
    """This rank's shard of the model, its tokenizer and its executor (``args`` resolved: a model
    and an attention backend; ``rank_sync``: rank 0's under tensor parallelism)."""
    device = rank_device(args.device, mapping)
    if device.index is not None:
        torch.cuda.set_device(device)
    config = load_config(args.model)
    if args.dtype != "auto":
        dtype = getattr(torch, args.dtype)
    else:
        dtype = getattr(torch, config.torch_dtype) if device.type == "cuda" else torch.float32
    quant_algo = args.quant_config.quant_algo if args.quant_config is not None else None
    mtp = isinstance(args.speculative_config, MTPDecodingConfig)
    model = load_model(
        args.model,
        dtype,
        device,
        args.attn_backend,
        mapping,
        quant_algo,
        args.load_format,
        **(mtp_options(args.speculative_config) if mtp else {}),
    )
    tokenizer = (
        None
        if args.skip_tokenizer_init
        else TransformersTokenizer.from_pretrained(
            args.tokenizer or args.model, chat_template=args.chat_template
        )
    )
    max_seq_len = args.max_seq_len or config.max_position_embeddings
    executor_config = args.to_executor_config(
        max_seq_len, str(dtype).removeprefix("torch."), str(device), mapping
    )
    executor = create_py_executor(model, executor_config, rank_sync, tokenizer)
    return RankEngine(
        config, model, dtype, device, tokenizer, max_seq_len, executor, executor.transceiver
    )


def join_ranks(engine: RankEngine, mapping: Mapping) -> None:
    """What every rank does together once all are ready (``disaggregation/parallel.py``)."""
    if engine.transceiver is not None and in_lockstep(mapping):
        connect_ranks(engine.transceiver, mapping)


class Followers:
    """Ranks 1..N-1 of a multi-rank LLM, as child processes."""

    def __init__(self, args: TorchLlmArgs, mapping: Mapping) -> None:
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        context = mp.get_context("spawn")
        self._pipes, self._processes = [], []
        for rank in range(1, mapping.world_size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_follower_main,
                args=(
                    args.model_dump_json(exclude_unset=True),
                    mapping.for_rank(rank),
                    self.init_method,
                    theirs,
                ),
                name=f"trtllm-rank{rank}",
                daemon=True,
            )
            process.start()
            self._pipes.append(ours)
            self._processes.append(process)

    def wait(self, stage: str) -> None:
        """Wait until every follower reports ``stage``; raise with a follower's error text."""
        for rank, (pipe, process) in enumerate(zip(self._pipes, self._processes), start=1):
            if not pipe.poll(READY_TIMEOUT_S):
                raise RuntimeError(f"rank {rank} did not report {stage!r} in {READY_TIMEOUT_S} s")
            try:
                kind, detail = pipe.recv()
            except EOFError:
                raise RuntimeError(
                    f"rank {rank} exited (code {process.exitcode}) before {stage!r}"
                ) from None
            if kind != stage:
                self.kill()
                raise RuntimeError(f"rank {rank} failed to start:\n{detail}")

    def lost(self) -> str | None:
        """Which follower's process has exited, if any."""
        for rank, process in enumerate(self._processes, start=1):
            if process.exitcode is not None:
                return f"rank {rank} exited (code {process.exitcode})"
        return None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Wait for the followers to exit (after rank 0's shutdown command); kill any that hang."""
        for process in self._processes:
            process.join(timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join()


def _follower_main(args_json: str, mapping: Mapping, init_method: str, pipe) -> None:
    """A follower rank's process: join, build, report ready, follow rank 0 until it shuts down."""
    logger.set_rank(mapping.rank)
    try:
        args = TorchLlmArgs.model_validate_json(args_json)
        device = rank_device(args.device, mapping)
        if device.type == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads() // mapping.world_size))
        pipe.send(("joining", None))
        init_distributed(mapping, init_method, device.type)
        engine = build_rank(args, mapping)
    except Exception:
        pipe.send(("error", traceback.format_exc()))
        return
    freeze_startup_heap()
    pipe.send(("ready", None))
    reporter = ProgressReporter(engine.executor, mapping) if mapping.enable_attention_dp else None
    try:
        join_ranks(engine, mapping)
        follow(engine.executor, mapping, reporter, engine.transceiver)
    except Exception:
        logger.error("rank %d stopped:\n%s", mapping.rank, traceback.format_exc())
    finally:
        engine.executor.shutdown()
        shutdown_distributed()
