"""CUDAGraphRunner: generation-only steps replayed from CUDA graphs, one per batch-size bucket.

A step whose batch is all generation requests, each with ``1 + max_draft_len`` input tokens, runs
as one graph: the target forward, the logits, the tokens, and with one-model Eagle3 the greedy
accept and the whole draft chain (``Eagle3OneModelWorker.decode``, the eager step's code). A
batch may sample (temperature, top-k, top-p, seeds: per-row buffers, its own graph per bucket):
target-only through ``sampler.sample``, Eagle3 by rejection sampling against the drafter's q,
which stays on the device (``DraftProbStore``, its slots per row an input of the bucket).
Penalties and logit bias apply inside the graph too, from counts kept on the device
(``LogitsState``). Prefill, mixed batches and a batch larger than every bucket run eagerly.

Per bucket of ``B`` sequences the runner owns the step's device inputs for the bucket's life: the
token ids and each sequence's first position (one host-to-device copy per step), and two metadata
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
from tensorrt_llm._torch.pyexecutor.graph_bucket import Bucket, GraphStep, addresses
from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens
from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState, PenaltyRows, draft_pairs
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.sampler import (
    host_rows,
    logprobs_top,
    sample,
    uses_top_k,
)
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.token_feed import on_device
from tensorrt_llm.logger import logger
from tensorrt_llm.runtime.staging import PinnedStaging
from tensorrt_llm.sampling_params import MAX_LOGPROBS

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
        bufs = [s.buffer for b in self._buckets.values() for s in b.staging if s.buffer is not None]
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
    def run(self, batch: ScheduledRequests, batch_size: int) -> GraphStep:
        """Run ``batch`` in bucket ``batch_size`` (``bucket_size``): write its inputs, then replay
        its graph (or, without ``capture``, run the step's ops on the bucket's buffers)."""
        requests = batch.generation_requests
        pad = batch_size - len(requests)
        request_ids = [r.request_id for r in requests] + [PADDING_REQUEST_ID] * pad
        key = self._key(batch, batch_size)
        bucket = self._buckets.get(key) or self._new_bucket(request_ids, key)
        self._write_inputs(bucket, batch, request_ids)
        if not self.options.capture:
            bucket.outputs = self._step(bucket)
        else:
            if addresses(bucket, self._store, self._logits_state) != bucket.addresses:
                raise RuntimeError(
                    f"the CUDA graph of batch size {batch_size} reads tensors that moved"
                )
            bucket.graph.replay()
        self.num_replays += 1
        return self._result(bucket, batch)

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
                self._write_padding(bucket, request_ids)
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
        per_row = width + 1 + (3 + (self.spec_worker is not None) if sampled else 0)
        size = batch_size * per_row
        inputs = torch.zeros(size, dtype=torch.long, device=device)
        floats = torch.zeros(2 * batch_size, device=device) if sampled else None
        staging = tuple(PinnedStaging() for _ in range(4))

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
            )

        chain_md = metadata(1) if self.spec_worker is not None else None
        bucket = Bucket(
            batch_size,
            inputs,
            metadata(width),
            chain_md,
            float_inputs=floats,
            staging=staging,
            uses_top_k=mode == TOP_K,
            top_logprobs=MAX_LOGPROBS if extras else None,
        )
        if extras:
            self._logits_state.allocate()  # (padding and plain rows read its zero scratch row)
            bucket.penalty_slots = torch.zeros(batch_size, dtype=torch.long, device=device)
            bucket.penalties = torch.zeros(2, batch_size, device=device)
        self._buckets[key] = bucket
        return bucket

    def _write_inputs(
        self, bucket: Bucket, batch: ScheduledRequests, request_ids: list[int]
    ) -> None:
        """The batch's tokens and first positions in one host-to-device copy; the block tables
        (and the draft manager's, where the drafter reads it) into the bucket's buffers."""
        requests = batch.generation_requests
        pad = bucket.batch_size - len(requests)
        tokens = [t for r in requests for t in (r.get_tokens()[-1], *r.py_draft_tokens)]
        tokens += [0] * (pad * self.tokens_per_seq)
        tokens += [r.get_num_tokens() - 1 for r in requests] + [0] * pad
        if bucket.sampled:  # padded rows: greedy
            floats, ints = host_rows(requests)
            tokens += [v for row in ints for v in row + [0] * pad]
            if self.spec_worker is not None:
                store = self.spec_worker.draft_probs
                tokens += store.slots(requests) + [store.scratch] * pad
            values = [
                v for row, fill in zip(floats, (0.0, 1.0), strict=True) for v in row + [fill] * pad
            ]
            bucket.staging[1].upload(bucket.float_inputs, torch.tensor(values, dtype=torch.float32))
        bucket.staging[0].upload(bucket.inputs, torch.tensor(tokens, dtype=torch.long))
        if bucket.penalties is not None:  # padded rows: the scratch slot, no penalty
            slots = self._logits_state.slots(requests) + [self._logits_state.scratch] * pad
            bucket.staging[2].upload(bucket.penalty_slots, torch.tensor(slots, dtype=torch.long))
            values = [
                [float(getattr(r.sampling_params, name) or 0.0) for r in requests] + [0.0] * pad
                for name in ("presence_penalty", "frequency_penalty")
            ]
            bucket.staging[3].upload(bucket.penalties, torch.tensor(values, dtype=torch.float32))
        fed = [i for i, r in enumerate(requests) if batch.pending_tokens(r)]
        if fed:  # from the launched step not yet read: the tokens, and the positions moved
            ids, advance = batch.feed.take([requests[i].request_id for i in fed])
            slots = on_device(fed, bucket.inputs.device)
            bucket.input_ids.view(bucket.batch_size, -1)[slots] = ids
            bucket.first_positions[slots] += advance
        self._rebind(bucket, request_ids)

    def _write_padding(self, bucket: Bucket, request_ids: list[int]) -> None:
        """Inputs of padding rows only (greedy, no penalty), for a capture at start-up."""
        bucket.inputs.zero_()  # token 0 at position 0; top-k 0, seed 0, counter 0
        if bucket.sampled:
            temperature, top_p = bucket.float_inputs.view(2, -1)
            temperature.zero_()  # greedy
            top_p.fill_(1.0)
            if self.spec_worker is not None:
                bucket.slots.fill_(self._store.scratch)
        if bucket.penalties is not None:
            bucket.penalty_slots.fill_(self._logits_state.scratch)
            bucket.penalties.zero_()
        self._rebind(bucket, request_ids)

    def _rebind(self, bucket: Bucket, request_ids: list[int]) -> None:
        """The rows' block tables into the bucket's metadata (and the draft chain's)."""
        bucket.md.rebind(request_ids)
        if self.spec_worker is not None:
            draft_manager = self.spec_worker.resolve_draft_kv()
            self.spec_worker.prefetch_draft_table(bucket.md, draft_manager)
            bucket.chain_md.rebind(request_ids, copied_from=bucket.md)

    def _step(self, bucket: Bucket) -> tuple[torch.Tensor, ...]:
        """The captured work: device tensors in, device tensors out."""
        engine, md = self.engine, bucket.md
        md.place(bucket.first_positions)
        hidden, captured = engine.model(
            bucket.input_ids, attn_metadata=md, capture_layers=engine.capture_layers
        )
        logits = engine.model.compute_logits(hidden)
        if bucket.penalties is not None:
            self._adjust(bucket, logits)
        if self.spec_worker is None:
            tokens = sample(logits, bucket.sampling()) if bucket.sampled else logits.argmax(-1)
            outputs = (tokens.view(bucket.batch_size, 1),)
        else:
            st, slots = (bucket.sampling(), bucket.slots) if bucket.sampled else (None, None)
            outputs = self.spec_worker.decode(
                bucket.input_ids, logits, captured, md, bucket.chain_md, st, slots
            )
        if bucket.penalties is not None:  # the tokens just made count from the next step on
            spec = self.spec_worker is not None
            made = outputs[1] + 1 if spec else torch.ones_like(outputs[0][:, 0])
            self._logits_state.record(bucket.penalty_slots, outputs[0], made)
        if bucket.top_logprobs is None:
            return logits, *outputs
        with_logprobs = DeviceTokens(list(range(bucket.batch_size)), outputs[0])
        with_logprobs.with_logprobs(logits, bucket.top_logprobs)
        return logits, *outputs, *with_logprobs.logprobs

    def _adjust(self, bucket: Bucket, logits: torch.Tensor) -> None:
        """Penalties and bias, in place: ``T`` rows per sequence, each counting the drafts
        ahead of it (``logits_processing``)."""
        num_seqs, width = bucket.batch_size, self.tokens_per_seq
        device = logits.device
        pairs = draft_pairs(
            bucket.input_ids.view(num_seqs, width)[:, 1:],
            torch.full((num_seqs,), width - 1, device=device),
            torch.arange(num_seqs, device=device) * width,
        )
        rows = PenaltyRows(
            bucket.penalty_slots.repeat_interleave(width),
            *bucket.penalties.repeat_interleave(width, dim=1),
            *pairs,
        )
        self._logits_state.adjust(logits, rows)

    @property
    def _logits_state(self) -> LogitsState:
        return self.resource_manager.get_resource_manager(ResourceManagerType.LOGITS_STATE)

    def _capture(self, bucket: Bucket) -> None:
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles the kernels (padding rows: the scratch slots)
            self._step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.outputs = self._step(bucket)
        bucket.graph, bucket.addresses = graph, addresses(bucket, self._store, self._logits_state)
        graph.replay()
        self.num_captures += 1

    def _result(self, bucket: Bucket, batch: ScheduledRequests) -> GraphStep:
        """The bucket's outputs, for the batch's rows (views: the next replay rewrites them)."""
        n, width = len(batch.generation_requests), self.tokens_per_seq
        logits, target, *spec = bucket.outputs
        logprobs = None
        if bucket.top_logprobs is not None:
            spec, logprobs = spec[:-3], tuple(t[:n] for t in spec[-3:])
        tokens = DeviceTokens(list(range(n)), target[:n], *(t[:n] for t in spec))
        tokens.logprobs = logprobs
        return GraphStep(logits[: n * width], [width] * n, tokens)
