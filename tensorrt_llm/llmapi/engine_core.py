"""EngineCore: what runs requests behind ``LLM``: the ranks (rank 0 here, the others as child
processes), their executors, the engine loop and the KV transceiver.

``LLM`` holds one in its own process by default (offline use); ``trtllm-serve`` runs one in a
process of its own (``core_process.py``), which holds an ``EngineCore`` the same way. Everything
the front side needs from it goes through the calls below: requests in (``submit``, ``cancel``,
``finish``), a step's outputs out (each request's ``on_update``), and read-outs taken between steps
(``kv_cache_report``, ``stats``).
"""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from tensorrt_llm._torch.distributed.communicator import init_distributed, shutdown_distributed
from tensorrt_llm._torch.executors.data_parallel import AttentionDpExecutor
from tensorrt_llm._torch.executors.ranks import TensorParallelLeader, stop_followers
from tensorrt_llm._torch.pyexecutor.engine_loop import EngineLoop, Submit
from tensorrt_llm._torch.pyexecutor.executor import Executor
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType
from tensorrt_llm.llmapi.disaggregated import DisaggregatedServing
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from tensorrt_llm.llmapi.workers import (
    Followers,
    build_rank,
    join_ranks,
    leave_a_core,
    rank_device,
)
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import GuidedDecodingParams


class EngineCore:
    def __init__(self, args: TorchLlmArgs, flush: Callable[[], object] | None = None) -> None:
        """Build every rank of ``args`` (resolved: a model and an attention backend). ``flush``:
        run at the end of every engine loop iteration (an engine process sends the step's
        outputs then)."""
        self.args = args
        self.mapping = args.mapping()
        self.device = rank_device(args.device, self.mapping)
        self._followers: Followers | None = None
        if self.mapping.world_size > 1:  # ranks 1..N-1 in child processes; this one is rank 0
            logger.set_rank(0)
            self._followers = Followers(args, self.mapping)
        try:
            if self._followers is not None:
                self._followers.wait("joining")
                init_distributed(self.mapping, self._followers.init_method, self.device.type)
            tensor_parallel = self.mapping.world_size > 1 and not self.mapping.enable_attention_dp
            rank_sync = TensorParallelLeader(self.lost_rank) if tensor_parallel else None
            engine = build_rank(args, self.mapping, rank_sync)
            if self._followers is not None:
                self._followers.wait("ready")
                join_ranks(engine, self.mapping)
        except BaseException:
            if self._followers is not None:
                self._followers.kill()
                shutdown_distributed()
            raise
        self.dtype = engine.dtype
        self.config = engine.config
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        self.rank_executor: PyExecutor = engine.executor  # this rank's
        self.executor: Executor = engine.executor
        if self.mapping.enable_attention_dp and self.mapping.world_size > 1:
            self.executor = AttentionDpExecutor(engine.executor, self.mapping, self.lost_rank)
        self.kv_cache_manager = self.executor.kv_cache_manager  # (white-box tests read it)
        self.limits = self.executor.limits
        self.disaggregated = DisaggregatedServing(
            engine.transceiver, self.executor, self.rank_executor, self.mapping, self.between_steps
        )
        # between steps, free the KV generation servers pulled
        housekeeping = self.disaggregated.release_pulled if self.disaggregated.enabled else None
        self.loop = EngineLoop(self.executor, housekeeping, flush)
        self.kv_slots = self.limits.kv_slots
        self.tokens_per_block = self.limits.tokens_per_block
        self.closed = False

    # ---- requests --------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine loop on a thread of its own from now on (``LLM.submit``; until then
        ``run_until`` steps on the caller's thread, which loaded the model: on a CPU the loop's
        steps leave it a core, ``leave_a_core``)."""
        if not self.loop.running:
            leave_a_core(self.device, "the thread that loaded the model")
        self.loop.start()

    def submit(self, command: Submit) -> None:
        """Queue a validated request for the engine loop."""
        self.loop.submit(command)

    def cancel(self, request_id: int) -> None:
        self.loop.cancel(request_id)

    def finish(self, request_id: int, reason: FinishReason, stop_reason: str) -> None:
        """End a request the output side stopped (a stop string); from an ``on_update`` only."""
        self.executor.finish_request(request_id, reason, stop_reason)

    def run_until(self, done: threading.Event) -> None:
        """Wait for ``done``: stepping on this thread while no loop thread runs."""
        if not self.loop.running:
            self.loop.run_until(done.is_set)
        elif self.loop.on_loop_thread:
            raise RuntimeError("LLM.generate cannot run inside an on_update callback")
        else:
            done.wait()

    def between_steps(self, fn: Callable[[], object]):
        """``fn()`` where no step runs: on the engine loop's thread while it runs, else here."""
        if self.loop.running and not self.loop.on_loop_thread:
            return self.loop.call(fn).result()
        return fn()

    # ---- read-outs ---------------------------------------------------------------------------------
    def kv_cache_report(self) -> dict:
        """Every KV manager's slot counts, checked with ``check_integrity()``, and the requests
        active and held for pulls (between steps)."""
        return self.between_steps(self._kv_cache_report)

    def _kv_cache_report(self) -> dict:
        snap = self.executor.snapshot(check_integrity=True)
        out: dict = {
            kind: {"free": kv.free, "used": kv.used, "cached": kv.cached,
                   "live_requests": kv.live_requests}
            for kind, kv in snap.kv.items()
        }  # fmt: skip
        out["held_for_transfer"] = snap.held_for_transfer
        out["active_requests"] = snap.active_requests
        return out

    def stats(self) -> dict:
        """The executor's counts, the KV slots, the draft KV mode, the experts' tokens and the
        images (between steps; ``LLM.get_stats``)."""
        return self.between_steps(self._stats)

    def _stats(self) -> dict:
        snap, limits = self.executor.snapshot(), self.limits
        kv = snap.kv[ResourceManagerType.KV_CACHE_MANAGER.value]
        encoder = self.rank_executor.model_engine.encoder  # (this rank's images)
        return {
            **dataclasses.asdict(snap.stats),
            "avg_decoded_tokens_per_iter": snap.stats.avg_decoded_tokens_per_iter,
            "active_requests": snap.active_requests,
            "held_for_transfer": snap.held_for_transfer,
            "kv_free_slots": kv.free,
            "kv_used_slots": kv.used,
            "kv_cached_slots": kv.cached,
            "kv_reused_blocks": kv.reused_blocks,
            "kv_total_slots": limits.kv_slots,
            "speculative": limits.max_draft_len > 0,
            "draft_kv_mode": snap.draft_kv_mode,
            # per expert, the (token, choice) slots routed to it (every rank's tokens), and
            # the expert groups that split them (``moe_expert_parallel_size``)
            "expert_tokens": snap.expert_tokens,
            "moe_ep_size": self.mapping.moe_ep_size,
            "images_encoded": encoder.cache.num_encoded if encoder is not None else 0,
            "image_cache_hits": encoder.cache.num_hits if encoder is not None else 0,
        }

    def compile_guide(self, guide: GuidedDecodingParams) -> Future:
        """``guide`` compiled ahead of a request that carries it (``LLM.compile_guide``): a
        future done once it is compiled, whose exception says why it cannot be used."""
        if not self.loop.running or self.loop.on_loop_thread:
            return self._compile_guide(guide.to_json())
        return chained(self.loop.call(lambda: self._compile_guide(guide.to_json())))

    def _compile_guide(self, guide: dict) -> Future:
        """(On the engine loop's thread: the compiler's cache is the requests'.) ``guide`` as
        ``GuidedDecodingParams.to_json`` writes it."""
        guided = self.rank_executor.guided
        if guided is None:
            raise ValueError("guided_decoding needs LLM(guided_decoding_backend='xgrammar')")
        return guided.prepare(GuidedDecodingParams(**guide))

    def _held_slots(self) -> int:
        return self.disaggregated.held_slots()

    def _release_pulled(self) -> int:
        return self.disaggregated.release_pulled()

    def lost_rank(self) -> str | None:
        """With several ranks: which one's process is gone (None while all run)."""
        return None if self._followers is None else self._followers.lost()

    # ---- lifetime ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the loop and the other ranks, free the KV, end the NIXL agent, leave
        torch.distributed, then give the device memory back (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        if self._followers is not None:
            stop_followers(self.lost_rank)
        self.loop.shutdown()  # first: its thread is the one that talks to the other ranks
        self.rank_executor.shutdown()
        self.disaggregated.close()
        if self._followers is not None:
            shutdown_distributed()  # with the followers: NCCL's teardown waits for every rank
            self._followers.stop()
            self._followers = None
            logger.set_rank(None)
        self.model = self.rank_executor = self.executor = self.kv_cache_manager = None
        self.loop = None
        gc.collect()  # (modules and executors reference each other)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()


def chained(outer: Future) -> Future:
    """The future that ``outer``'s result (a future) settles; ``outer``'s own error settles it
    too."""
    done: Future = Future()

    def copy(future: Future) -> None:
        if future.exception() is not None:
            done.set_exception(future.exception())
        elif isinstance(future.result(), Future):
            future.result().add_done_callback(copy)
        else:
            done.set_result(future.result())

    outer.add_done_callback(copy)
    return done
