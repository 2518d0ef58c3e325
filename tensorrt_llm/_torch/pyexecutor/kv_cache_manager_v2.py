"""KVCacheManagerV2: the KV cache engine as the executor's resource manager, with the tensors attached.

The engine (``runtime/kv_cache_manager_v2``) does the bookkeeping; this class owns the pool tensors,
the host block table (``HostBlockTable``) and the per-step ``prepare``/``update``/``free`` protocol.

Addressing, as published to attention ops: ``kv_slot_views.py``.

Request protocol (see ``update_resources``): after a step, a context request's KV is final up to
``context_current_position``; a generation request's up to ``get_num_tokens() - 1`` (every token but
the newest, whose KV the next step writes). Only those tokens are committed; a generation request's
capacity is then rewound to them, which drops the rejected drafts' slots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from tensorrt_llm._torch.attention_backend.interface import ScalePages
from tensorrt_llm._torch.pyexecutor.config import (
    KV_STORAGE_DTYPES,
    KvCacheLayer,
    KVCacheManagerV2Config,
)
from tensorrt_llm._torch.pyexecutor.kv_slot_views import SlotViews
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm.logger import logger
from tensorrt_llm.runtime.kv_cache_manager_v2 import (
    AllocationResult,
    AttentionLayerConfig,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStats,
    plan_storage,
)
from tensorrt_llm.runtime.kv_cache_manager_v2.host_block_table import HostBlockTable
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import allocate_pools


def engine_layer(
    layer_id: int, layer: KvCacheLayer, dtype: str, is_draft: bool
) -> AttentionLayerConfig:
    """The storage engine's description of one layer: K and V, and on a sparse layer one index-K
    head; a draft layer's KV depends on the next token (the drafter boundary rule). ``dtype`` is
    the KV dtype (``fp8``: every buffer in float8_e4m3fn with its scales)."""
    dtype = KV_STORAGE_DTYPES.get(dtype, dtype)
    index_key = (1, layer.index_head_dim, dtype) if layer.index_head_dim else None
    return AttentionLayerConfig.kv(
        layer_id,
        layer.num_kv_heads,
        layer.head_dim,
        dtype,
        index_key=index_key,
        depends_on_next_token=is_draft,
    )


class KVCacheManagerV2(BaseResourceManager):
    """Slot-coalesced KV cache for the executor, built from one ``KVCacheManagerV2Config``.

    The config lists the whole layer stack (target layers, then one-model draft layers, each with
    its own geometry) and which of them this manager holds.
    """

    supports_shared_draft_layers: bool = False

    def __init__(self, config: KVCacheManagerV2Config) -> None:
        self.config = config
        self.is_draft = config.is_draft
        self.max_seq_len = config.max_seq_len
        self.max_batch_size = config.max_batch_size
        self.tokens_per_block = config.tokens_per_block
        self.dtype = config.options.dtype
        self.device = torch.device(config.device)
        self.pp_layers = list(config.layer_ids)
        self.max_blocks_per_seq = config.max_blocks_per_seq

        layers = tuple(self._layer_config(layer_id) for layer_id in self.pp_layers)
        engine_config = KVCacheManagerConfig(
            tokens_per_block=self.tokens_per_block,
            layers=layers,
            num_slots=1,
            enable_block_reuse=config.options.enable_block_reuse,
            max_blocks_per_seq=self.max_blocks_per_seq,
            **self._storage_options(),
        )
        num_slots = self._num_slots(sum(p.slot_bytes for p in plan_storage(engine_config).pools))
        self.impl = KVCacheManager(dataclasses.replace(engine_config, num_slots=num_slots))
        self.layout = self.impl.layout
        self.pools: list[torch.Tensor] = allocate_pools(self.layout, num_slots, self.device)
        self.views = SlotViews(self.layout, self.pools)
        self.host_block_table = HostBlockTable(
            len(self.pools),
            self.max_batch_size,
            self.max_blocks_per_seq,
            pin_memory=self.device.type == "cuda",
        )
        self._caches: dict[int, KVCache] = {}
        self._padding_blocks = 0  # held by padding sequences (add_padding_sequence)
        logger.debug("KV cache layout:\n%s", self.describe())

    # ---- construction hooks (the MiniMax-M3 manager overrides these) ---------------------------
    def is_draft_layer(self, layer_id: int) -> bool:
        return self.is_draft or self.config.layers[layer_id].is_draft

    def _layer_config(self, layer_id: int) -> AttentionLayerConfig:
        layer = self.config.layers[layer_id]
        return engine_layer(layer_id, layer, self.dtype, self.is_draft_layer(layer_id))

    def _storage_options(self) -> dict:
        return {}

    def _num_slots(self, bytes_per_slot: int) -> int:
        options = self.config.options
        if options.max_tokens is not None:
            return math.ceil(options.max_tokens / self.tokens_per_block)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            num = int(free * options.free_gpu_memory_fraction) // bytes_per_slot
            if num <= 0:
                raise ValueError(
                    f"free_gpu_memory_fraction={options.free_gpu_memory_fraction} of {free} free "
                    f"bytes holds no {bytes_per_slot}-byte slot"
                )
            return num
        return self.max_batch_size * self.max_blocks_per_seq

    # ---- tensors (zero-copy views of the pools: ``SlotViews``) ------------------------------------
    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> torch.Tensor:
        """``[num_slots, 2, tokens_per_block, num_kv_heads, head_dim]`` view of a layer's K and V."""
        if kv_layout != "NHD":
            raise ValueError(
                f"kv_layout={kv_layout!r}: this cache stores blocks token-major ('NHD') only"
            )
        return self.views.kv(layer_idx)

    def get_index_k_buffers(self, layer_idx: int) -> torch.Tensor:
        """``[num_slots, tokens_per_block, index_heads, index_head_dim]`` view of index-K."""
        return self.views.index_k(layer_idx)

    def get_kv_pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged-KV contract (``attention_backend/interface.py``): K and V page tensors
        ``[num_slots, tokens_per_block, heads, head_dim]``; here a page is a slot, indexed by slot id."""
        kv = self.get_buffers(layer_idx)
        return kv[:, 0], kv[:, 1]

    def get_index_k_pages(self, layer_idx: int) -> torch.Tensor:
        """Index-K pages, addressed like K (lane 0 of the block table)."""
        return self.views.index_k(layer_idx)

    def get_kv_scales(self, layer_idx: int) -> tuple[ScalePages, ScalePages] | None:
        """K's and V's row scales in an FP8 cache, else ``None``."""
        return self.views.kv_scales(layer_idx)

    def get_index_k_scales(self, layer_idx: int) -> ScalePages | None:
        """Index-K's row scales in an FP8 cache, else ``None``."""
        return self.views.index_k_scales(layer_idx)

    def layer_pool_index(self, layer_idx: int) -> int:
        return self.layout.pool_of_layer(layer_idx)

    @property
    def num_pools(self) -> int:
        return len(self.pools)

    @property
    def blocks_in_primary_pool(self) -> int:
        return self.impl.num_slots

    @property
    def kv_cache_pool_pointers(self) -> torch.Tensor:
        """``[num_pools, 2]`` int64: each pool's base address, and 0 (no secondary pool)."""
        return torch.tensor([[p.data_ptr(), 0] for p in self.pools], dtype=torch.int64)

    @property
    def kv_cache_pool_mapping(self) -> torch.Tensor:
        """``[num_local_layers, 2]`` int32: (pool index, byte offset of the layer's K in a slot)."""
        return self.views.pool_mapping(self.pp_layers)

    def slot_bytes(self, pool_index: int = 0) -> int:
        return self.layout.pools[pool_index].slot_bytes

    # ---- sequences --------------------------------------------------------------------------------
    def add_sequence(
        self, request_id: int, prompt_tokens: Sequence[int], reuse_scope: str | None = None
    ) -> int:
        """Track a new request, holding its longest reusable prefix; returns the reused token count."""
        if request_id in self._caches:
            raise ValueError(f"request {request_id} already has a KV cache")
        if len(prompt_tokens) > self.max_seq_len:
            raise ValueError(
                f"request {request_id}: prompt of {len(prompt_tokens)} tokens exceeds "
                f"max_seq_len={self.max_seq_len}"
            )
        cache = self.impl.create_kv_cache(prompt_tokens, reuse_scope)
        self._caches[request_id] = cache
        self.host_block_table.add(request_id)
        self.host_block_table.sync(request_id, cache.block_table)
        return cache.num_reused_tokens

    def add_padding_sequence(self, request_id: int, num_tokens: int) -> None:
        """Hold slots for ``num_tokens`` positions under ``request_id`` for the manager's life: the
        rows that pad a CUDA graph batch write their throwaway KV there. Never committed (nothing
        reuses it) and not counted by ``get_max_resource_count``."""
        self.add_sequence(request_id, [])
        if not self.resize_sequence(request_id, num_tokens):
            self.free_sequence(request_id)
            raise RuntimeError(
                f"no free KV slot for the CUDA graph padding sequence ({num_tokens} tokens); "
                "start the executor before admitting requests"
            )
        self._padding_blocks += self._caches[request_id].num_blocks

    def resize_sequence(self, request_id: int, capacity: int) -> AllocationResult:
        result = self._caches[request_id].resize(capacity)
        if result:
            self.host_block_table.sync(request_id, self._caches[request_id].block_table)
        return result

    def commit_sequence(
        self,
        request_id: int,
        num_final_tokens: int,
        tokens: Sequence[int],
        shrink: bool = True,
        first: int = 0,
    ) -> None:
        """Commit tokens ``[num_committed, num_final_tokens)`` of the sequence, whose tokens from
        position ``first`` on are ``tokens``, and (``shrink``) give back the blocks past
        ``num_final_tokens`` (the rejected drafts' and the draft chain's). Capacity inside the
        last kept block stays reserved: the next step reuses it without a resize."""
        cache = self._caches[request_id]
        new = tokens[cache.num_committed_tokens - first : num_final_tokens - first]
        if len(new):
            cache.commit(new)
        if shrink and -(-num_final_tokens // self.tokens_per_block) < cache.num_blocks:
            cache.resize(num_final_tokens)
            self.host_block_table.sync(request_id, cache.block_table)

    def free_sequence(self, request_id: int) -> None:
        cache = self._caches.pop(request_id, None)
        if cache is None:
            return
        cache.close()
        self.host_block_table.remove(request_id)

    def get_cache(self, request_id: int) -> KVCache:
        return self._caches[request_id]

    # ---- the executor protocol ----------------------------------------------------------------------
    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """Reserve slots for every scheduled request's step: its input positions and, with one-model
        speculation, the draft chain that follows acceptance (``max_draft_len - 1`` positions past the
        last accepted one). A request that cannot get them is moved to
        ``scheduled_batch.paused_requests`` with nothing held (a new one is forgotten entirely).

        A context request whose prompt starts with a reused prefix is reported in
        ``scheduled_batch.reused_tokens`` (the executor then skips those tokens); requests are not
        edited here. A separate draft manager mirrors the target's report; it never decides."""
        paused = []
        for req in scheduled_batch.context_requests:
            if not self._prepare_context(req, scheduled_batch):
                paused.append(req)
        for req in scheduled_batch.generation_requests:
            capacity = (
                req.get_num_tokens()
                + scheduled_batch.pending_tokens(req)
                + len(req.py_draft_tokens)
                + self._draft_chain_tokens
            )
            if not self._reserve(req.request_id, capacity):
                paused.append(req)
        if paused:
            scheduled_batch.pause(paused)

    def _prepare_context(self, req: LlmRequest, batch: ScheduledRequests) -> bool:
        rid = req.request_id
        is_new = rid not in self._caches
        if is_new:
            self.add_sequence(rid, req.prompt_key_ids, req.cache_salt)
        start = max(req.context_current_position, batch.reused_tokens.get(rid, 0))
        if not self.is_draft:
            start = max(start, self._caches[rid].num_reused_tokens)
            if start > req.context_current_position:
                batch.reused_tokens[rid] = start
        end = min(req.prompt_len, start + req.context_chunk_size)
        if end == req.prompt_len:
            end += self._draft_chain_tokens
        if self._reserve(rid, end):
            return True
        if is_new:
            self.free_sequence(rid)
            if not self.is_draft:
                batch.reused_tokens.pop(rid, None)
        return False

    @property
    def _draft_chain_tokens(self) -> int:
        return max(self.config.max_draft_len - 1, 0)

    def _reserve(self, request_id: int, capacity: int) -> bool:
        """Hold at least ``capacity`` positions, to the end of the last block they need (the same
        slots; the next steps inside that block then need no resize)."""
        cache = self._caches[request_id]
        if capacity <= cache.capacity:
            return True
        tpb = self.tokens_per_block
        whole = min(-(-capacity // tpb), self.max_blocks_per_seq) * tpb
        return bool(self.resize_sequence(request_id, max(capacity, whole)))

    def update_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """Commit what the step made final; drop the slots of rejected drafts (not those a later
        launched step holds: ``scheduled_batch.keep_capacity``)."""
        keep = scheduled_batch.keep_capacity
        for req in scheduled_batch.context_requests:
            self.commit_sequence(
                req.request_id,
                req.context_current_position,
                req.prompt_key_ids,
                shrink=req.request_id not in keep,
            )
        for req in scheduled_batch.generation_requests:
            final = req.get_num_tokens() - 1
            start = min(self._caches[req.request_id].num_committed_tokens, final)
            self.commit_sequence(
                req.request_id,
                final,
                req.key_tokens(start, final),  # not the whole context: a step's few tokens
                shrink=req.request_id not in keep,
                first=start,
            )

    def free_resources(self, request: LlmRequest) -> None:
        self.free_sequence(request.request_id)

    def shutdown(self) -> None:
        for request_id in list(self._caches):
            self.free_sequence(request_id)

    def get_max_resource_count(self) -> int:
        return self.impl.num_slots - self._padding_blocks

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        total = min(self.max_seq_len, request.prompt_len + request.max_new_tokens)
        total += self.config.num_extra_kv_tokens
        held = (
            self._caches[request.request_id].num_blocks if request.request_id in self._caches else 0
        )
        return max(0, math.ceil(total / self.tokens_per_block) - held)

    # ---- batch tables -------------------------------------------------------------------------------
    @property
    def host_kv_cache_block_offsets(self) -> torch.Tensor:
        """``[num_pools, num_rows, 2, max_blocks_per_seq]`` slot ids (see ``HostBlockTable``)."""
        return self.host_block_table.table

    def get_batch_cache_indices(
        self, request_ids: Sequence[int], layer_idx: int | None = None
    ) -> list[list[int]]:
        """Slot id per logical block, per request (the same for every layer of a life cycle)."""
        del layer_idx
        return [list(self._caches[r].block_table) for r in request_ids]

    def copy_batch_block_offsets(
        self,
        dst_tensor: torch.Tensor,
        request_ids: Sequence[int],
        beam_width: int = 1,
        num_contexts: int = 0,
        num_seqs: int | None = None,
    ) -> None:
        """The batch's rows of the host block table into ``dst_tensor[:, :n]``
        (``[num_pools, >= n, 2, max_blocks_per_seq]``) in one indexed copy."""
        del num_contexts
        self.host_block_table.copy_batch(dst_tensor, request_ids, beam_width, num_seqs)

    # ---- stats ----------------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Slots an allocation could get now: free plus evictable cached."""
        return self.impl.num_available_slots

    def get_kv_cache_stats(self) -> KVCacheStats:
        return self.impl.stats()

    def describe(self) -> str:
        """The slot layout and pool size (see ``StorageLayout.describe``)."""
        return self.impl.describe()

    def check_integrity(self) -> None:
        self.impl.check_integrity()
        for request_id, cache in self._caches.items():
            self.host_block_table.check(request_id, cache.block_table)
