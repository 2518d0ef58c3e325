"""CUDAGraphRunner: generation-only steps replayed from CUDA graphs, one per batch-size bucket.

A step whose batch is all generation requests, each with ``1 + max_draft_len`` input tokens, runs
as one graph of the step program every step runs (``step_program.run_step``, on the bucket's
``StepInputs``): the target forward, the logits, the tokens, and with one-model Eagle3 the accept
and the whole draft chain. A batch may sample (temperature, top-k, top-p, seeds: per-row buffers, its own graph per bucket):
target-only through ``sampler.sample``, Eagle3 by rejection sampling against the drafter's q,
which stays on the device (``DraftProbStore``, its slots per row an input of the bucket).
Penalties and logit bias apply inside the graph too, from counts kept on the device
(``LogitsState``). Prefill, mixed batches and a batch larger than every bucket run eagerly.

Per bucket of ``B`` sequences the runner owns the step's device inputs for the bucket's life: the
token ids, each sequence's first position and the rows' values (``step_inputs.bucket_inputs``: one
host-to-device copy per dtype and step), and two metadata
objects (the step's and the draft chain's) whose buffers never move. Before each replay the host
copies the batch's block tables into them (``rebind``; the draft manager's only where the
drafter's backend reads it); inside the graph the positions and lengths are derived on the device
(``place``) and the launches are sized by ``kv_len_bound`` (the table's width) instead of the
step's lengths. A batch of ``n < B`` requests is padded with rows of a padding sequence that each
KV manager holds for its life (``add_padding_sequence``), so padded rows write only there.

A bucket is keyed by its batch size, how it samples (greedy; sampled by top-p and temperature;
sampled with a top-k, whose draws sort) and whether it has the extras: penalties and bias, and
the logprobs of ``MAX_LOGPROBS`` top tokens (each request then keeps the top count it asked for).
A batch in which any request asks for penalties, bias or logprobs runs in an extras bucket.

Every bucket is captured at start-up (``capture_all``, on rows of the padding sequence): one eager
run of the step (it compiles the kernels), the capture, then the replay. No graph is captured
after that, so every rank of a multi-rank engine replays the same graphs from its first step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, MetadataBuffers
from tensorrt_llm._torch.pyexecutor.config import CudaGraphOptions
from tensorrt_llm._torch.pyexecutor.graph_bucket import Bucket, addresses
from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens
from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.sampler import uses_top_k
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.step_inputs import (
    RowLayout,
    bucket_inputs,
    logprobs_top,
    write_bucket,
)
from tensorrt_llm._torch.pyexecutor.step_program import StepOutputs, run_step
from tensorrt_llm._torch.pyexecutor.token_feed import on_device
from tensorrt_llm.logger import logger

if TYPE_CHECKING:
    from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore
    from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker

PADDING_REQUEST_ID = -1  # the padding sequence's id in every KV manager (request ids are >= 0)
GREEDY, NUCLEUS, TOP_K = 0, 1, 2  # how a bucket samples


class CUDAGraphRunner:
    def __init__(
        self,
        engine: PyTorchModelEngine,
        resource_manager: ResourceManager,
        options: CudaGraphOptions,
        spec_worker: Eagle3OneModelWorker | None = None,
    ) -> None:
        backend = engine.model.attn_backend
        drafter_backend = spec_worker.draft_model.attn_backend if spec_worker else backend
        if not (backend.supports_cuda_graphs and drafter_backend.supports_cuda_graphs):
            raise ValueError(
                f"cuda_graph_config needs an attention backend without host syncs (TRITON); "
                f"this model runs on {backend.name!r}"
            )
        if options.capture and engine.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {engine.device}")
        self.engine = engine
        self.resource_manager = resource_manager
        self.options = options
        self.spec_worker = spec_worker
        self.max_draft_len = spec_worker.max_draft_len if spec_worker else 0
        self.tokens_per_seq = 1 + self.max_draft_len
        target = engine.kv_cache_manager
        self.kv_len_bound = target.max_blocks_per_seq * target.tokens_per_block
        self._buckets: dict[int, Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if options.capture else None
        self.num_replays = 0
        self.num_captures = 0
        if options.enable_padding or options.capture:  # (capture_all runs on padding rows)
            for kind in (
                ResourceManagerType.KV_CACHE_MANAGER,
                ResourceManagerType.DRAFT_KV_CACHE_MANAGER,
            ):
                manager = resource_manager.get_resource_manager(kind)
                if manager is not None:  # positions of the step and of the draft chain
                    manager.add_padding_sequence(PADDING_REQUEST_ID, 2 * self.tokens_per_seq)

    @property
    def _store(self) -> DraftProbStore | None:
        return self.spec_worker.draft_probs if self.spec_worker is not None else None

    def release(self) -> None:
        """Drop every captured graph (before the process leaves torch.distributed: NCCL's
        teardown waits on a communicator whose kernels a live graph still holds)."""
        if self._pool is not None:  # graphs were captured (on CUDA)
            torch.cuda.synchronize(self.engine.device)
        self._buckets.clear()

    @property
    def captured_batch_sizes(self) -> list[int]:
        return sorted({b for (b, *_), bucket in self._buckets.items() if bucket.graph is not None})

    @property
    def inputs_pinned(self) -> bool:
        """Every bucket's inputs went up from pinned memory (a pageable copy waits for the device)."""
        bufs = [
            s.buffer
            for b in self._buckets.values()
            for s in b.inputs.staging
            if s.buffer is not None
        ]
        return bool(bufs) and all(x.is_pinned() for x in bufs)

    def bucket_size(self, batch: ScheduledRequests) -> int | None:
        """The bucket that runs ``batch``, or None when it must run eagerly."""
        requests = batch.generation_requests
        if batch.context_requests or not requests:
            return None
        for req in requests:
            if len(req.py_draft_tokens) != self.max_draft_len:
                return None
        n = len(requests)
        sizes = self.options.batch_sizes
        if not self.options.enable_padding:
            size = n if n in sizes else None
        else:
            size = next((b for b in sizes if b >= n), None)
        if size is not None and self.options.capture:  # (only a bucket captured at start-up)
            bucket = self._buckets.get(self._key(batch, size))
            size = size if bucket is not None and bucket.graph is not None else None
        return size

    @torch.inference_mode()
    def run(self, batch: ScheduledRequests, batch_size: int) -> tuple[torch.Tensor, DeviceTokens]:
        """Run ``batch`` in bucket ``batch_size`` (``bucket_size``): write its inputs, then replay
        its graph (or, without ``capture``, run the step program on the bucket's tensors).
        Returns the batch's logits rows and tokens (views: the next replay rewrites them)."""
        requests = batch.generation_requests
        pad = batch_size - len(requests)
        request_ids = [r.request_id for r in requests] + [PADDING_REQUEST_ID] * pad
        key = self._key(batch, batch_size)
        bucket = self._buckets.get(key) or self._new_bucket(request_ids, key)
        self._write_inputs(bucket, batch, request_ids)
        if not self.options.capture:
            bucket.outputs = self._run_step(bucket)
        else:
            if addresses(bucket, self._store, self._logits_state) != bucket.addresses:
                raise RuntimeError(
                    f"the CUDA graph of batch size {batch_size} reads tensors that moved"
                )
            bucket.graph.replay()
        self.num_replays += 1
        out = bucket.outputs.first(len(requests))
        rows = list(range(len(requests)))
        return out.logits, DeviceTokens(
            rows, out.tokens, out.num_accepted, out.drafts, out.logprobs
        )

    @staticmethod
    def _key(batch: ScheduledRequests, batch_size: int) -> tuple[int, int, bool]:
        requests = batch.generation_requests
        mode = GREEDY
        if not all(r.sampling_params.greedy for r in requests):
            mode = TOP_K if uses_top_k(requests) else NUCLEUS
        extras = logprobs_top(requests) is not None or any(
            r.sampling_params.processes_logits for r in requests
        )
        return batch_size, mode, extras

    @torch.inference_mode()  # (as ``run``: the buffers it makes are the replays')
    def capture_all(self) -> None:
        """Capture every bucket (each batch size, way of sampling, with and without the extras)
        on rows of the padding sequence, with a progress bar; the time is logged."""
        if not self.options.capture:
            return
        if self.spec_worker is not None:
            self._store.allocate()
        self._logits_state.allocate()
        keys = [
            (size, mode, extras)
            for size in self.options.batch_sizes
            for mode in (GREEDY, NUCLEUS, TOP_K)
            for extras in (False, True)
        ]
        start = time.perf_counter()
        for key in tqdm(keys, desc="capturing CUDA graphs", unit="graph", leave=False):
            if key not in self._buckets:
                request_ids = [PADDING_REQUEST_ID] * key[0]
                bucket = self._new_bucket(request_ids, key)
                write_bucket(bucket.inputs, [], self._logits_state, self._store)  # padding rows
                self._rebind(bucket, request_ids)
                self._capture(bucket)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s; greedy, top-p and top-k sampling; with and "
            "without penalties and logprobs) in %.1f s",
            len(keys),
            list(self.options.batch_sizes),
            time.perf_counter() - start,
        )

    def _new_bucket(self, request_ids: list[int], key: tuple) -> Bucket:
        """A bucket for ``len(request_ids)`` sequences, its metadata first bound to these."""
        device, width, batch_size = self.engine.device, self.tokens_per_seq, len(request_ids)
        _, mode, extras = key
        sampled = mode != GREEDY
        layout = RowLayout(sampled, sampled and self.spec_worker is not None, extras)
        if extras:
            self._logits_state.allocate()  # (padding and plain rows read its zero scratch row)
        inputs = bucket_inputs(
            batch_size, self.max_draft_len, layout, mode == TOP_K, extras, device
        )
        exchange = self.engine.exchange

        def metadata(seq_len: int) -> AttentionMetadata:
            return AttentionMetadata(
                kv_cache_manager=self.engine.kv_cache_manager,
                request_ids=request_ids,
                seq_lens=[seq_len] * batch_size,
                num_cached_tokens_per_seq=[0] * batch_size,  # placed on the device per step
                num_contexts=0,
                device=device,
                buffers=MetadataBuffers(device),
                kv_len_bound=self.kv_len_bound,
                moe_capacity=exchange.capacity if exchange is not None else None,  # (fixed)
            )

        chain_md = metadata(1) if self.spec_worker is not None else None
        bucket = self._buckets[key] = Bucket(inputs, metadata(width), chain_md)
        return bucket

    def _write_inputs(
        self, bucket: Bucket, batch: ScheduledRequests, request_ids: list[int]
    ) -> None:
        """The batch's tokens, first positions and rows (``step_inputs.write_bucket``); the
        tokens of requests fed from the launched step not yet read; the block tables (and the
        draft manager's, where the drafter reads it) into the bucket's metadata."""
        requests = batch.generation_requests
        write_bucket(bucket.inputs, requests, self._logits_state, self._store)
        fed = [i for i, r in enumerate(requests) if batch.pending_tokens(r)]
        if fed:  # from the launched step not yet read: the tokens, and the positions moved
            step = bucket.inputs.step
            ids, advance = batch.feed.take([requests[i].request_id for i in fed])
            slots = on_device(fed, step.input_ids.device)
            step.input_ids.view(bucket.batch_size, -1)[slots] = ids
            step.first_positions[slots] += advance
        self._rebind(bucket, request_ids)

    def _rebind(self, bucket: Bucket, request_ids: list[int]) -> None:
        """The rows' block tables into the bucket's metadata (and the draft chain's)."""
        bucket.md.rebind(request_ids)
        if self.spec_worker is not None:
            draft_manager = self.spec_worker.resolve_draft_kv()
            self.spec_worker.prefetch_draft_table(bucket.md, draft_manager)
            bucket.chain_md.rebind(request_ids, copied_from=bucket.md)

    def _run_step(self, bucket: Bucket) -> StepOutputs:
        """The captured work: ``run_step`` on the bucket's tensors."""
        return run_step(
            self.engine,
            bucket.inputs.step,
            bucket.md,
            logits_state=self._logits_state,
            spec_worker=self.spec_worker,
            chain_md=bucket.chain_md,
        )

    @property
    def _logits_state(self) -> LogitsState:
        return self.resource_manager.get_resource_manager(ResourceManagerType.LOGITS_STATE)

    def _capture(self, bucket: Bucket) -> None:
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles the kernels (padding rows: the scratch slots)
            self._run_step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.outputs = self._run_step(bucket)
        bucket.graph, bucket.addresses = graph, addresses(bucket, self._store, self._logits_state)
        graph.replay()
        self.num_captures += 1
