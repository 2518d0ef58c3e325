"""KVCacheManagerV2: the KV cache engine as the executor's resource manager, with the tensors attached.

The engine (``runtime/kv_cache_manager_v2``) does the bookkeeping; this class owns the pool tensors,
the per-request host block table, and the per-step ``prepare``/``update``/``free`` protocol.

Addressing, as published to attention ops::

    pool p         kv_cache_pool_pointers[p, 0]: base address of a [num_slots, slot_bytes] byte tensor
    layer l        kv_cache_pool_mapping[l] = (pool index, byte offset of l's K inside a slot)
    block b of r   host_kv_cache_block_offsets[p, row(r), lane, b] = slot id (lane 0: K, lane 1: V;
                   both hold the slot id here; views with sub-page addressing fill them differently)
    K of (r,b,t)   base + slot * slot_bytes + k_offset(l) + t * bytes_per_token
    V              the same, + K's bytes per block (V follows K in the slot)

Entries past a row's last block hold slot 0: they are never read (kernels stop at the row's length).

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

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager, get_pp_layers
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.speculative.utils import get_num_extra_kv_tokens
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig
from tensorrt_llm.logger import logger
from tensorrt_llm.runtime.kv_cache_manager_v2 import (
    AllocationResult,
    AttentionLayerConfig,
    DataRole,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStats,
    plan_storage,
)
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import allocate_pools, buffer_view, kv_view


def _dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return dtype


def _per_layer(name: str, value: int | Sequence[int], total: int) -> list[int]:
    if isinstance(value, int):
        return [value] * total
    values = list(value)
    if len(values) != total:
        raise ValueError(
            f"{name} has {len(values)} entries but the KV cache has {total} layers "
            f"(target layers plus one-model draft layers); give one per layer or a single int"
        )
    return values


class KVCacheManagerV2(BaseResourceManager):
    """Slot-coalesced KV cache for the executor.

    ``num_layers`` is the target model's layer count; a one-model ``spec_config`` appends its draft
    layers after them (``get_pp_layers``). ``num_kv_heads`` / ``head_dim`` are an int or one entry per
    layer of the full stack (drafts included), so a drafter's geometry may differ from the target's.
    """

    supports_shared_draft_layers: bool = False

    def __init__(
        self,
        kv_cache_config: KvCacheConfig,
        *,
        num_layers: int,
        num_kv_heads: int | Sequence[int],
        head_dim: int | Sequence[int],
        tokens_per_block: int = 128,
        max_seq_len: int,
        max_batch_size: int,
        dtype: torch.dtype | str = "bfloat16",
        spec_config: Eagle3DecodingConfig | None = None,
        is_draft: bool = False,
        layer_mask: Sequence[bool] | None = None,
        mapping: object | None = None,
        device: torch.device | str = "cpu",
        num_one_model_draft_layers: int = 0,
    ) -> None:
        del (
            num_one_model_draft_layers
        )  # the M3 manager uses it; this one derives drafts from spec_config
        if max_seq_len <= 0 or max_batch_size <= 0:
            raise ValueError(
                f"max_seq_len={max_seq_len} and max_batch_size={max_batch_size} must be positive"
            )
        self.kv_cache_config = kv_cache_config
        self.is_draft = is_draft
        self.spec_config = spec_config
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.tokens_per_block = tokens_per_block
        self.dtype = _dtype_name(dtype)
        self.device = torch.device(device)
        self.num_target_layers = num_layers
        self.pp_layers, self.num_layers = get_pp_layers(
            num_layers, mapping, spec_config, layer_mask
        )
        self.num_kv_heads_per_layer = _per_layer("num_kv_heads", num_kv_heads, self.num_layers)
        self.head_dim_per_layer = _per_layer("head_dim", head_dim, self.num_layers)
        self.max_blocks_per_seq = math.ceil(
            (max_seq_len + get_num_extra_kv_tokens(spec_config)) / tokens_per_block
        )

        layers = tuple(self._layer_config(layer_id) for layer_id in self.pp_layers)
        config = KVCacheManagerConfig(
            tokens_per_block=tokens_per_block,
            layers=layers,
            num_slots=1,
            enable_block_reuse=kv_cache_config.enable_block_reuse,
            max_blocks_per_seq=self.max_blocks_per_seq,
            **self._storage_options(),
        )
        num_slots = self._num_slots(sum(p.slot_bytes for p in plan_storage(config).pools))
        self.impl = KVCacheManager(dataclasses.replace(config, num_slots=num_slots))
        self.layout = self.impl.layout
        self.pools: list[torch.Tensor] = allocate_pools(self.layout, num_slots, self.device)
        self.layer_offsets = {layer_id: i for i, layer_id in enumerate(self.pp_layers)}

        # [num_pools, max_batch_size, 2, max_blocks_per_seq]: slot ids per request row (see module doc).
        self.host_kv_cache_block_offsets = torch.zeros(
            len(self.pools),
            max_batch_size,
            2,
            self.max_blocks_per_seq,
            dtype=torch.int32,
            pin_memory=self.device.type == "cuda",
        )
        self._caches: dict[int, KVCache] = {}
        self._rows: dict[int, int] = {}
        self._free_rows = list(range(max_batch_size - 1, -1, -1))
        self._row_lengths: dict[int, int] = {}
        logger.debug("KV cache layout:\n%s", self.describe())

    # ---- construction hooks (the MiniMax-M3 manager overrides these) ---------------------------
    def is_draft_layer(self, layer_id: int) -> bool:
        return self.is_draft or layer_id >= self.num_target_layers

    def _layer_config(self, layer_id: int) -> AttentionLayerConfig:
        return AttentionLayerConfig.kv(
            layer_id,
            self.num_kv_heads_per_layer[layer_id],
            self.head_dim_per_layer[layer_id],
            self.dtype,
            index_key=self._index_key(layer_id),
            depends_on_next_token=self.is_draft_layer(layer_id),
        )

    def _index_key(self, layer_id: int) -> tuple[int, int, str] | None:
        """``(heads, head_dim, dtype)`` of the layer's index-K buffer, or None (none here)."""
        return None

    def _storage_options(self) -> dict:
        return {}

    def _num_slots(self, bytes_per_slot: int) -> int:
        cfg = self.kv_cache_config
        if cfg.max_tokens is not None:
            return math.ceil(cfg.max_tokens / self.tokens_per_block)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            num = int(free * cfg.free_gpu_memory_fraction) // bytes_per_slot
            if num <= 0:
                raise ValueError(
                    f"free_gpu_memory_fraction={cfg.free_gpu_memory_fraction} of {free} free bytes holds no "
                    f"{bytes_per_slot}-byte slot"
                )
            return num
        return self.max_batch_size * self.max_blocks_per_seq

    # ---- tensors --------------------------------------------------------------------------------
    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> torch.Tensor:
        """Zero-copy ``[num_slots, 2, tokens_per_block, num_kv_heads, head_dim]`` view of a layer's K
        and V; the slot stride is the slot size."""
        if kv_layout != "NHD":
            raise ValueError(
                f"kv_layout={kv_layout!r}: this cache stores blocks token-major ('NHD') only"
            )
        pool, key = self.layout.placement(layer_idx, DataRole.KEY)
        return kv_view(self.pools[pool.pool_index], pool, key)

    def get_index_k_buffers(self, layer_idx: int) -> torch.Tensor:
        """Zero-copy ``[num_slots, tokens_per_block, index_heads, index_head_dim]`` view of index-K."""
        if not self.layout.has(layer_idx, DataRole.INDEX_KEY):
            raise KeyError(f"layer {layer_idx} has no index_key buffer")
        pool, buf = self.layout.placement(layer_idx, DataRole.INDEX_KEY)
        return buffer_view(self.pools[pool.pool_index], pool, buf)

    def get_kv_pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged-KV contract (``attention_backend/interface.py``): K and V page tensors
        ``[num_slots, tokens_per_block, heads, head_dim]``; here a page is a slot, indexed by slot id."""
        kv = self.get_buffers(layer_idx)
        return kv[:, 0], kv[:, 1]

    def get_index_k_pages(self, layer_idx: int) -> torch.Tensor:
        """Index-K pages, addressed like K (lane 0 of the block table)."""
        return self.get_index_k_buffers(layer_idx)

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
        rows = []
        for layer_id in self.pp_layers:
            pool, key = self.layout.placement(layer_id, DataRole.KEY)
            rows.append([pool.pool_index, key.offset])
        return torch.tensor(rows, dtype=torch.int32)

    def slot_bytes(self, pool_index: int = 0) -> int:
        return self.layout.pools[pool_index].slot_bytes

    # ---- sequences --------------------------------------------------------------------------------
    def add_sequence(
        self, request_id: int, prompt_tokens: Sequence[int], reuse_scope: str | None = None
    ) -> int:
        """Track a new request, holding its longest reusable prefix; returns the reused token count."""
        if request_id in self._caches:
            raise ValueError(f"request {request_id} already has a KV cache")
        if not self._free_rows:
            self._grow_rows()
        if len(prompt_tokens) > self.max_seq_len:
            raise ValueError(
                f"request {request_id}: prompt of {len(prompt_tokens)} tokens exceeds max_seq_len={self.max_seq_len}"
            )
        cache = self.impl.create_kv_cache(prompt_tokens, reuse_scope)
        self._caches[request_id] = cache
        self._rows[request_id] = self._free_rows.pop()
        self._row_lengths[request_id] = 0
        self._sync_row(request_id)
        return cache.num_reused_tokens

    def _grow_rows(self) -> None:
        """Double the host block table: live sequences can outnumber the batch (requests held
        for a disaggregated transfer, say); only the scheduled ones are ever copied to a kernel."""
        table = self.host_kv_cache_block_offsets
        rows = table.shape[1]
        grown = torch.zeros(
            table.shape[0],
            2 * rows,
            *table.shape[2:],
            dtype=table.dtype,
            pin_memory=table.is_pinned(),
        )
        grown[:, :rows] = table
        self.host_kv_cache_block_offsets = grown
        self._free_rows = list(range(2 * rows - 1, rows - 1, -1))

    def resize_sequence(self, request_id: int, capacity: int) -> AllocationResult:
        result = self._caches[request_id].resize(capacity)
        if result:
            self._sync_row(request_id)
        return result

    def commit_sequence(
        self, request_id: int, num_final_tokens: int, tokens: Sequence[int]
    ) -> None:
        """Commit ``tokens[num_committed : num_final_tokens]`` and rewind capacity to ``num_final_tokens``."""
        cache = self._caches[request_id]
        new = tokens[cache.num_committed_tokens : num_final_tokens]
        if len(new):
            cache.commit(new)
        if cache.capacity > num_final_tokens:
            cache.resize(num_final_tokens)
            self._sync_row(request_id)

    def free_sequence(self, request_id: int) -> None:
        cache = self._caches.pop(request_id, None)
        if cache is None:
            return
        cache.close()
        row = self._rows.pop(request_id)
        self.host_kv_cache_block_offsets[:, row].zero_()
        del self._row_lengths[request_id]
        self._free_rows.append(row)

    def get_cache(self, request_id: int) -> KVCache:
        return self._caches[request_id]

    def _sync_row(self, request_id: int) -> None:
        """Mirror the request's block table into its host row (only the entries that changed)."""
        table = self._caches[request_id].block_table
        row, old = self._rows[request_id], self._row_lengths[request_id]
        new = len(table)
        dst = self.host_kv_cache_block_offsets[:, row]  # [num_pools, 2, max_blocks_per_seq]
        if new > old:
            dst[:, :, old:new] = torch.tensor(table[old:], dtype=torch.int32)
        elif new < old:
            dst[:, :, new:old] = 0
        self._row_lengths[request_id] = new

    # ---- the executor protocol ----------------------------------------------------------------------
    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """Reserve slots for every scheduled request's step: its input positions and, with one-model
        speculation, the draft chain that follows acceptance (``max_draft_len - 1`` positions past the
        last accepted one). A request that cannot get them is moved to
        ``scheduled_batch.paused_requests`` with nothing held (a new one is forgotten entirely)."""
        paused = []
        for req in scheduled_batch.context_requests:
            is_new = req.request_id not in self._caches
            if is_new:
                reused = self.add_sequence(req.request_id, req.prompt_token_ids, req.cache_salt)
            if is_new and not self.is_draft:  # a separate draft manager mirrors; it never decides
                req.num_reused_tokens = reused
                if req.context_current_position < reused:
                    req.context_current_position = reused
                    req.context_chunk_size = min(req.context_chunk_size, req.prompt_len - reused)
            end = min(req.prompt_len, req.context_current_position + req.context_chunk_size)
            if end == req.prompt_len:
                end += self._draft_chain_tokens
            if not self._reserve(req.request_id, end):
                if is_new:
                    self.free_sequence(req.request_id)
                    if not self.is_draft:
                        req.context_current_position = 0
                paused.append(req)
        for req in scheduled_batch.generation_requests:
            capacity = req.get_num_tokens() + len(req.py_draft_tokens) + self._draft_chain_tokens
            if not self._reserve(req.request_id, capacity):
                paused.append(req)
        if paused:
            ids = {id(r) for r in paused}
            scheduled_batch.context_requests = [
                r for r in scheduled_batch.context_requests if id(r) not in ids
            ]
            scheduled_batch.generation_requests = [
                r for r in scheduled_batch.generation_requests if id(r) not in ids
            ]
            scheduled_batch.paused_requests.extend(paused)

    @property
    def _draft_chain_tokens(self) -> int:
        return self.spec_config.max_draft_len - 1 if self.spec_config is not None else 0

    def _reserve(self, request_id: int, capacity: int) -> bool:
        cache = self._caches[request_id]
        return capacity <= cache.capacity or bool(self.resize_sequence(request_id, capacity))

    def update_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """Commit what the step made final; drop the slots of rejected drafts."""
        for req in scheduled_batch.context_requests:
            self.commit_sequence(req.request_id, req.context_current_position, req.prompt_token_ids)
        for req in scheduled_batch.generation_requests:
            self.commit_sequence(req.request_id, req.get_num_tokens() - 1, req.get_tokens())

    def free_resources(self, request: LlmRequest) -> None:
        self.free_sequence(request.request_id)

    def shutdown(self) -> None:
        for request_id in list(self._caches):
            self.free_sequence(request_id)

    def get_max_resource_count(self) -> int:
        return self.impl.num_slots

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        total = min(self.max_seq_len, request.prompt_len + request.max_new_tokens)
        total += get_num_extra_kv_tokens(self.spec_config)
        held = (
            self._caches[request.request_id].num_blocks if request.request_id in self._caches else 0
        )
        return max(0, math.ceil(total / self.tokens_per_block) - held)

    # ---- batch tables -------------------------------------------------------------------------------
    def get_batch_cache_indices(
        self, request_ids: Sequence[int], layer_idx: int | None = None
    ) -> list[list[int]]:
        """Slot id per logical block, per request (the same for every layer of a life cycle)."""
        del layer_idx
        return [list(self._caches[r].block_table) for r in request_ids]

    def batch_rows(self, request_ids: Sequence[int]) -> torch.Tensor:
        """Host-table row of each request (one C-level map over the batch)."""
        return torch.tensor(list(map(self._rows.__getitem__, request_ids)), dtype=torch.long)

    def batch_rows_checked(
        self, request_ids: Sequence[int], beam_width: int, num_seqs: int | None
    ) -> torch.Tensor:
        """Host-table rows of the first ``num_seqs`` requests (all if None); beam width 1 only."""
        if beam_width != 1:
            raise ValueError(f"beam_width={beam_width}: only 1 is supported")
        n = len(request_ids) if num_seqs is None else num_seqs
        return self.batch_rows(request_ids[:n])

    def copy_batch_block_offsets(
        self,
        dst_tensor: torch.Tensor,
        request_ids: Sequence[int],
        beam_width: int = 1,
        num_contexts: int = 0,
        num_seqs: int | None = None,
    ) -> None:
        """Gather the batch's rows of ``host_kv_cache_block_offsets`` into ``dst_tensor[:, :n]``
        (``[num_pools, >= n, 2, max_blocks_per_seq]``) in one indexed copy."""
        del num_contexts
        rows = self.batch_rows_checked(request_ids, beam_width, num_seqs)
        n = rows.numel()
        src = self.host_kv_cache_block_offsets.index_select(1, rows)
        dst_tensor[:, :n].copy_(src, non_blocking=dst_tensor.device.type == "cuda")

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
            row = self.host_kv_cache_block_offsets[:, self._rows[request_id]]
            n = cache.num_blocks
            expect = torch.tensor(cache.block_table, dtype=torch.int32)
            if not (
                torch.equal(row[:, 0, :n], expect.expand(row.shape[0], n))
                and torch.equal(row[:, 1, :n], row[:, 0, :n])
            ):
                raise AssertionError(
                    f"request {request_id}: host block row differs from its block table"
                )
            if bool(row[:, :, n:].any()):
                raise AssertionError(
                    f"request {request_id}: host block row has entries past its blocks"
                )
