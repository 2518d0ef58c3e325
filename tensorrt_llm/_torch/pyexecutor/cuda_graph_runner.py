"""CUDAGraphRunner: steps replayed from CUDA graphs, one per bucket (``GraphShape``).

A step whose batch is generation requests, each with ``1 + max_draft_len`` input tokens, and at
most ``max_prompts`` prompts finishing (their last chunks, without images) runs as one graph of
the step program every step runs (``step_program.py``, on the bucket's ``StepInputs``; two
graphs, its two parts):
the target forward, the logits, the tokens, and with one-model Eagle3 the accept and the whole
draft chain. A batch may sample (temperature, top-k, top-p, seeds: per-row buffers, its own graph
per bucket): target-only through ``sampler.sample``, Eagle3 by rejection sampling against the
drafter's q, which stays on the device (``DraftProbStore``, its slots per row an input of the
bucket). Penalties and logit bias apply inside the graph too, from counts kept on the device
(``LogitsState``). Other prefill steps, and a batch larger than every bucket, run eagerly.

Per bucket of ``B`` decoding rows the runner owns the step's device inputs for the bucket's life:
the token ids, each sequence's first position and the rows' values (``step_inputs.bucket_inputs``:
one host-to-device copy per dtype and step), and two metadata objects (the step's and the draft
chain's) whose buffers never move. Before each replay the host copies the batch's block tables
into them (``rebind``; the draft manager's only where the drafter's backend reads it); inside the
graph the positions and lengths are derived on the device (``place``) and the launches are sized
by ``kv_len_bound`` (the table's width) instead of the step's lengths. A batch of ``n < B``
requests is padded with rows of a padding sequence that each KV manager holds for its life
(``add_padding_sequence``), so padded rows write only there.

A mixed bucket (``mixed_bucket.py``) has ``P`` prompt rows (1, 2, 4, ... up to ``max_prompts``)
before its ``B`` decoding rows, and ``P * mixed_prompt_tokens`` prompt tokens whose split between
the prompts is an input: so prompts that arrive while others decode, the usual case of a busy
server, neither run eagerly nor wait for the launched step to be read.

A bucket is keyed (``graph_shapes.py``) by its shape, how it samples (greedy; sampled by top-p
and temperature; sampled with a top-k, whose draws sort) and whether it has the extras: penalties
and bias, and the logprobs of ``MAX_LOGPROBS`` top tokens (each request then keeps the top count it
asked for). A batch in which any request asks for penalties, bias or logprobs runs in an extras
bucket; with a prompt, eagerly.

Every bucket is captured at start-up (``capture_all``, on rows of the padding sequence): one eager
run of the step (it compiles the kernels), the capture, then the replay. No graph is captured
after that, so every rank of a multi-rank engine replays the same graphs from its first step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, MetadataBuffers
from tensorrt_llm._torch.pyexecutor.config import CudaGraphOptions
from tensorrt_llm._torch.pyexecutor.graph_bucket import Bucket, addresses, new_bucket
from tensorrt_llm._torch.pyexecutor.graph_shapes import GREEDY, TOP_K, BucketKey, GraphShapes
from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
from tensorrt_llm._torch.pyexecutor.mixed_bucket import GraphShape, write_mixed_bucket
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.step_inputs import RowLayout, write_bucket, write_masks
from tensorrt_llm._torch.pyexecutor.step_program import (
    Forwarded,
    StepOutputs,
    finish_step,
    forward_step,
)
from tensorrt_llm._torch.pyexecutor.token_feed import on_device
from tensorrt_llm.logger import logger

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.guided_decoder import GuidedDecoder
    from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore
    from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker
    from tensorrt_llm._torch.speculative.interface import DraftGuide

PADDING_REQUEST_ID = -1  # the padding sequence's id in every KV manager (request ids are >= 0)


class CUDAGraphRunner:
    def __init__(
        self,
        engine: PyTorchModelEngine,
        resource_manager: ResourceManager,
        options: CudaGraphOptions,
        vocab_size: int,
        spec_worker: Eagle3OneModelWorker | None = None,
        guided: GuidedDecoder | None = None,
    ) -> None:
        """``guided``: the requests' grammars; an extras bucket then carries their mask rows."""
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
        self.guided = guided
        self._mask_words = math.ceil(vocab_size / 32) if guided is not None else 0
        self.max_draft_len = spec_worker.max_draft_len if spec_worker else 0
        self.tokens_per_seq = 1 + self.max_draft_len
        self.shapes = GraphShapes(options, self.max_draft_len)
        target = engine.kv_cache_manager
        self.kv_len_bound = target.max_blocks_per_seq * target.tokens_per_block
        self._buckets: dict[BucketKey, Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if options.capture else None
        # every bucket's logits, in one buffer: a graph's outputs outlive its capture, and
        # logits of the published vocabulary (200K) in each of ~170 buckets would hold GBs. A
        # bucket's are valid until the next replay (a step that returns them is read first).
        keys = self.shapes.keys()
        most_rows = max(shape.num_rows for shape, _, _ in keys)
        self._logits = torch.empty(
            most_rows * self.tokens_per_seq, vocab_size, dtype=torch.float32, device=engine.device
        )
        self.num_replays = 0
        self.num_mixed_replays = 0  # of them, steps with a prompt
        self.num_captures = 0
        # a bucket's rows start on the padding sequence (at capture: all of them); a mixed
        # bucket's tokens past its prompt's, and a padded batch's rows, stay on it
        for kind in (
            ResourceManagerType.KV_CACHE_MANAGER,
            ResourceManagerType.DRAFT_KV_CACHE_MANAGER,
        ):
            manager = resource_manager.get_resource_manager(kind)
            if manager is not None:
                manager.add_padding_sequence(PADDING_REQUEST_ID, self.shapes.padding_positions)

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
        keys = [k for k, b in self._buckets.items() if b.graph and not k[0].prompt_tokens]
        return sorted({k[0].batch_size for k in keys})

    @property
    def inputs_pinned(self) -> bool:
        """Every bucket's inputs went up from pinned memory (a pageable copy waits for the device)."""
        bufs = [s.buffer for b in self._buckets.values() for s in b.inputs.staging]
        bufs = [x for x in bufs if x is not None]
        return bool(bufs) and all(x.is_pinned() for x in bufs)

    def shape_of(self, batch: ScheduledRequests) -> GraphShape | None:
        """The bucket that runs ``batch`` (``GraphShapes.shape``), or None when it must run
        eagerly (with ``capture``: also when that bucket was not captured at start-up)."""
        shape = self.shapes.shape(batch)
        if shape is not None and self.options.capture:
            bucket = self._buckets.get(self.shapes.key(batch, shape))
            if bucket is None or bucket.graph is None:
                return None
        return shape

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduledRequests,
        shape: GraphShape,
        settle: Callable[[], object] | None = None,
    ) -> tuple[torch.Tensor, DeviceTokens]:
        """Run ``batch`` in the bucket of ``shape`` (``shape_of``): write its inputs, then replay
        its graphs (or, without ``capture``, run the step program on the bucket's tensors).
        ``settle``: read what the grammars' masks need, called once the first part is queued;
        the masks are written after it, before the second part. Returns the batch's logits rows
        and tokens (views: the next replay rewrites them)."""
        key = self.shapes.key(batch, shape)
        bucket = self._buckets.get(key) or self._new_bucket(key)
        self._write_inputs(bucket, batch, shape, masks=settle is None)
        if self.options.capture:
            if addresses(bucket, self._store, self._logits_state) != bucket.addresses:
                raise RuntimeError(f"the CUDA graph of {shape} reads tensors that moved")
            bucket.graph.replay()
        else:
            bucket.forwarded = self._forward(bucket)
        if settle is not None:
            settle()
            self._write_masks(bucket, batch.generation_requests)
        # the prompts' rows, then the decoding requests' (after the padding prompt rows)
        p, n = len(batch.context_requests), len(batch.generation_requests)
        rows = [*range(p), *[None] * (shape.num_prompts - p), *range(p, p + n)]
        guide = None  # the grammars' masks of the drafts, where a row has a grammar
        if self.spec_worker is not None and self.guided is not None:
            requests = [None if i is None else batch.all_requests[i] for i in rows]
            guide = self.guided.drafting(requests, self.engine.device)
        if guide is not None:  # (the host reads the drafts: the second part runs eagerly)
            outputs = self._finish(bucket, guide)
        elif self.options.capture:
            bucket.finish_graph.replay()
            outputs = bucket.outputs
        else:
            outputs = bucket.outputs = self._finish(bucket)
        self.num_replays += 1
        self.num_mixed_replays += shape.num_prompts > 0
        out = outputs.first(len(rows))
        return out.logits, DeviceTokens(
            rows, out.tokens, out.num_accepted, out.drafts, out.logprobs
        )

    @torch.inference_mode()  # (as ``run``: the buffers it makes are the replays')
    def capture_all(self) -> None:
        """Capture every bucket (each batch size, way of sampling, with and without the extras)
        on rows of the padding sequence, with a progress bar; the time is logged."""
        if not self.options.capture:
            return
        if self.spec_worker is not None:
            self._store.allocate()
        self._logits_state.allocate()
        # the largest steps first: the shared pool's blocks a larger graph freed hold every
        # smaller one's (smallest first, each capture would need blocks a little larger than
        # any free one, and the pool would grow by about every bucket's activations)
        keys = sorted(self.shapes.keys(), key=self._step_tokens, reverse=True)
        # one side stream for every warm-up run: the allocator caches a stream's freed blocks
        # for that stream only, so a new stream per capture would cache one step's worth each
        stream = torch.cuda.Stream(self.engine.device)
        start = time.perf_counter()
        for key in tqdm(keys, desc="capturing CUDA graphs", unit="graph", leave=False):
            if key not in self._buckets:
                bucket = self._new_bucket(key)
                self._write_rows(bucket, key[0], [], [])  # padding rows
                self._capture(bucket, stream)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s; greedy, top-p and top-k sampling; with and "
            "without penalties and logprobs; %s) in %.1f s",
            len(keys),
            list(self.options.batch_sizes),
            f"up to {self.shapes.prompt_slots[-1]} prompts of {self.options.mixed_prompt_tokens} "
            "tokens each beside them"
            if self.shapes.prompt_slots
            else "no prompt beside them",
            time.perf_counter() - start,
        )

    def _new_bucket(self, key: BucketKey) -> Bucket:
        """A bucket of ``key``'s shape, its metadata first bound to the padding sequence."""
        shape, mode, extras = key
        sampled = mode != GREEDY
        worker = self.spec_worker
        slots = worker is not None and (sampled or worker.draft_probs.phases is not None)
        layout = RowLayout(sampled, slots, extras)
        if extras:
            self._logits_state.allocate()  # (padding and plain rows read its zero scratch row)
        bucket = self._buckets[key] = new_bucket(
            shape,
            layout,
            mode == TOP_K,
            extras,
            self.max_draft_len,
            self.engine.device,
            self._metadata,
            draft_chain=self.spec_worker is not None,
            mask_words=self._mask_words,
        )
        return bucket

    def _metadata(self, seq_lens: list[int], num_contexts: int) -> AttentionMetadata:
        """A bucket's metadata on the padding sequence: ``seq_lens`` are bounds (the lengths are
        placed on the device per step)."""
        exchange = self.engine.exchange
        return AttentionMetadata(
            kv_cache_manager=self.engine.kv_cache_manager,
            request_ids=[PADDING_REQUEST_ID] * len(seq_lens),
            seq_lens=seq_lens,
            num_cached_tokens_per_seq=[0] * len(seq_lens),
            num_contexts=num_contexts,
            device=self.engine.device,
            buffers=MetadataBuffers(self.engine.device),
            kv_len_bound=self.kv_len_bound,
            moe_capacity=exchange.capacity if exchange is not None else None,  # (fixed)
        )

    def _write_inputs(
        self, bucket: Bucket, batch: ScheduledRequests, shape: GraphShape, masks: bool = True
    ) -> None:
        """The batch's rows (``_write_rows``; ``masks``: their grammars' masks too); the tokens of
        requests fed from the launched step not yet read, and their positions moved."""
        requests = batch.generation_requests
        offset = self._write_rows(bucket, shape, batch.context_requests, requests)
        if masks:
            self._write_masks(bucket, requests)
        fed = [i for i, r in enumerate(requests) if batch.pending_tokens(r)]
        if fed:  # from the launched step not yet read: the tokens, and the positions moved
            step, first_row = bucket.inputs.step, shape.num_prompts
            ids, advance = batch.feed.take([requests[i].request_id for i in fed])
            slots = on_device(fed, step.input_ids.device)
            width = self.tokens_per_seq
            rows = step.input_ids[offset : offset + shape.batch_size * width]
            rows.view(shape.batch_size, width)[slots] = ids
            if shape.prompt_tokens and self.max_draft_len:  # (else the drafts are token views)
                step.drafts[first_row + slots] = ids[:, 1:]
            step.first_positions[first_row + slots] += advance

    def _write_rows(
        self,
        bucket: Bucket,
        shape: GraphShape,
        prompts: list[LlmRequest],
        requests: list[LlmRequest],
    ) -> int:
        """The rows' tokens, positions and values (``step_inputs.write_bucket``, or
        ``mixed_bucket.write_mixed_bucket`` with the prompts' chunks) and their block tables (and
        the draft manager's, where the drafter reads it) into the bucket's metadata. Returns
        where the decoding rows' tokens start."""
        pad = [PADDING_REQUEST_ID] * (shape.batch_size - len(requests))
        row_ids = [r.request_id for r in requests] + pad
        if not shape.num_prompts:
            write_bucket(bucket.inputs, requests, self._logits_state, self._store)
            self._rebind(bucket, row_ids, row_ids)
            return 0
        offset = write_mixed_bucket(
            bucket.inputs, shape, prompts, requests, self._logits_state, self._store
        )
        self.engine.num_context_tokens_computed += offset - (shape.num_prompts - len(prompts))
        prompt_ids = [p.request_id for p in prompts]
        prompt_ids += [PADDING_REQUEST_ID] * (shape.num_prompts - len(prompts))
        rows = prompt_ids + row_ids
        self._rebind(bucket, [*rows, PADDING_REQUEST_ID], rows)
        return offset

    def _rebind(self, bucket: Bucket, seq_ids: list[int], row_ids: list[int]) -> None:
        """The sequences' block tables into the bucket's metadata, and the rows' (the first
        sequences) into the draft chain's."""
        bucket.md.rebind(seq_ids)
        if self.spec_worker is not None:
            draft_manager = self.spec_worker.resolve_draft_kv()
            self.spec_worker.prefetch_draft_table(bucket.md, draft_manager)
            bucket.chain_md.rebind(row_ids, copied_from=bucket.md)

    def _write_masks(self, bucket: Bucket, requests: list[LlmRequest]) -> None:
        """The decoding rows' grammar masks into an extras bucket (``GuidedDecoder.fill``)."""
        if bucket.inputs.bitmask is not None:
            write_masks(bucket.inputs, self.guided.fill(requests, self.tokens_per_seq))

    def _forward(self, bucket: Bucket) -> Forwarded:
        """The captured work's first part: ``forward_step`` on the bucket's tensors."""
        return forward_step(
            self.engine,
            bucket.inputs.step,
            bucket.md,
            logits_state=self._logits_state,
            logits_out=self._logits[: bucket.inputs.step.num_rows * self.tokens_per_seq],
        )

    def _finish(self, bucket: Bucket, draft_guide: DraftGuide | None = None) -> StepOutputs:
        """Its second part: ``finish_step`` on what the first left."""
        return finish_step(
            bucket.forwarded,
            bucket.inputs.step,
            bucket.md,
            logits_state=self._logits_state,
            spec_worker=self.spec_worker,
            chain_md=bucket.chain_md,
            draft_guide=draft_guide,
        )

    @property
    def _logits_state(self) -> LogitsState:
        return self.resource_manager.get_resource_manager(ResourceManagerType.LOGITS_STATE)

    def _step_tokens(self, key: BucketKey) -> int:
        """The tokens a bucket's step runs: its size in activations."""
        shape = key[0]
        return shape.prompt_tokens + shape.batch_size * self.tokens_per_seq

    def _capture(self, bucket: Bucket, stream: torch.cuda.Stream) -> None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles the kernels (padding rows: the scratch slots)
            bucket.forwarded = self._forward(bucket)
            self._finish(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(first, pool=self._pool):
            bucket.forwarded = self._forward(bucket)
        with torch.cuda.graph(second, pool=self._pool):  # (reading what the first left)
            bucket.outputs = self._finish(bucket)
        # the first part's outputs may now share memory with later buckets' graphs: a bucket's
        # two parts replay back to back, with no other graph between them. A bucket with mask
        # rows under speculation keeps them: its second part may run eagerly (drafts masked)
        if bucket.inputs.bitmask is None or self.spec_worker is None:
            bucket.forwarded = None
        bucket.graph, bucket.finish_graph = first, second
        bucket.addresses = addresses(bucket, self._store, self._logits_state)
        first.replay()
        second.replay()
        self.num_captures += 1
