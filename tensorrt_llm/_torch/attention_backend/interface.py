"""The attention side's two contracts: what an op may read from a KV cache manager
(``PagedKVCache``), and one step's batch as every op sees it (``AttentionMetadata``).

**The paged-KV contract.** An op never computes a byte offset of its own. It asks the manager attached to the step's metadata
for a layer's **page tensors** and reads them through the step's block table:

    k_pages, v_pages = manager.get_kv_pages(layer)   # each [num_pages, tokens_per_block, heads, head_dim]
    K of logical block b of batch row r = k_pages[block_offsets[pool, r, 0, b]]
    V of logical block b of batch row r = v_pages[block_offsets[pool, r, 1, b]]

``tokens_per_block`` is the manager's. With an FP8 cache the page tensors hold ``float8_e4m3fn`` rows
and ``manager.get_kv_scales(layer)`` gives their float32 scales (``ScalePages``: one per token and
head; ``kv_quant.py``); with a 16- or 32-bit cache it gives ``None``. Swapping the manager (for example for the Eagle3 draft
sub-page view) therefore changes the page size and the addressing an op sees, with no change to the op.

**The step's batch.** ``AttentionMetadata`` is built once per step by the model engine. Sequences are ordered contexts first, then generations.
The step's tokens are flattened: sequence ``i`` owns tokens ``[cu_seqlens[i], cu_seqlens[i+1])``
at positions ``[num_cached_tokens[i], kv_lens[i])``::

    tokens   | seq 0 (context chunk) ........ | seq 1 (ctx) ... | seq 2 (gen) | seq 3 (gen: last + drafts) |
    position   c0 .. c0+len0-1                  c1 ..             c2            c3 .. c3+k

The block table (``kv_cache_block_offsets``) and the page size come from ``kv_cache_manager``;
``swap_kv_cache_manager`` replaces both for the span of a ``with`` block (the Eagle3 draft loop reads
its KV through another manager or a sub-page view) and restores them afterwards, even on error. A
swapped-in manager's table is copied only when something reads it (a kernel that computes the draft
sub-page addresses from the target's slot table never does), or ahead of time with
``prefetch_block_offsets`` (a CUDA graph replay, where nothing may copy from the host).

Device tensors live in ``MetadataBuffers`` given by the owner (the model engine, the draft chain):
allocated once, grown only when a step needs more, reused every step, so no per-step allocation of
the block table. ``advance`` moves a one-token-per-sequence batch (the Eagle3 draft chain) to its
next positions on the same tensors, without rebuilding the metadata or re-copying the table.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tensorrt_llm.runtime.staging import PinnedStaging


@dataclass(frozen=True)
class ScalePages:
    """The float32 scales of a page tensor's (token, head) rows in an FP8 cache: page ``p``'s are
    ``tensor[p // page_units, p % page_units]`` ``[page_tokens, heads]``.

    A manager's pages are slots (``page_units`` 1); the draft sub-page view's pages are
    ``slot_units`` to a slot, and its K and V pages share one scale tensor, V's scale pages
    following K's as V's pages follow K's."""

    tensor: torch.Tensor  # [num_slots, pages_per_slot, page_tokens, heads] float32
    page_units: int = 1

    def of(self, page: torch.Tensor) -> torch.Tensor:
        """The scales of pages ``page`` (any shape): ``[*page.shape, page_tokens, heads]``."""
        return self.tensor[page // self.page_units, page % self.page_units]


class PagedKVCache(Protocol):
    """Every member an attention op (or a kernel launcher) may read from the manager attached to
    the step's metadata. Implemented by ``KVCacheManagerV2`` (pages = slots) and by
    ``MiniMaxM3DraftSubpageView`` (pages = 32-token sub-pages of the same slots)."""

    tokens_per_block: int  # tokens per kernel page
    max_blocks_per_seq: int  # block-table entries per row
    num_pools: int
    blocks_in_primary_pool: int  # pages addressable from the pool base, in this object's page units

    @property
    def kv_cache_pool_pointers(self) -> torch.Tensor:
        """``[num_pools, 2]`` int64: each pool's base address (page 0), and 0."""
        ...

    def get_kv_pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get_kv_scales(self, layer_idx: int) -> tuple[ScalePages, ScalePages] | None:
        """K's and V's row scales (FP8), or ``None`` (rows stored as they are)."""
        ...

    def layer_pool_index(self, layer_idx: int) -> int: ...

    def copy_batch_block_offsets(
        self,
        dst_tensor: torch.Tensor,
        request_ids: list[int],
        beam_width: int = 1,
        num_contexts: int = 0,
        num_seqs: int | None = None,
    ) -> None: ...


PAGED_KV_CACHE_MEMBERS = (
    "tokens_per_block",
    "max_blocks_per_seq",
    "num_pools",
    "blocks_in_primary_pool",
    "kv_cache_pool_pointers",
    "get_kv_pages",
    "get_kv_scales",
    "layer_pool_index",
    "copy_batch_block_offsets",
)


class MetadataBuffers:
    """Persistent device tensors, one per name, handed out as views of the size a step needs; on
    CUDA each has a pinned host twin its contents are staged through (``put``), so the copy is
    queued and the host goes on."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._twins: dict[str, PinnedStaging] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` view of buffer ``name`` (contents undefined); reallocated only to grow."""
        numel = math.prod(shape)
        buf = self._tensors.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = torch.empty(size, dtype=dtype, device=self.device)
            self._tensors[name] = buf
        return buf[:numel].view(shape)

    def put(self, name: str, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Buffer ``name`` holding a copy of the host tensor ``host`` (as ``dtype``)."""
        dst = self.take(name, tuple(host.shape), dtype)
        return self._twins.setdefault(name, PinnedStaging()).upload(dst, host)


@dataclass
class AttentionMetadata:
    kv_cache_manager: PagedKVCache
    request_ids: list[int]
    seq_lens: list[int]  # query tokens per sequence this step
    num_cached_tokens_per_seq: list[int]  # KV positions each sequence already had
    num_contexts: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    buffers: MetadataBuffers | None = None  # None: private buffers (tests, one-off metadata)

    # A bound on every kv_lens[i] of this and later steps on the same tensors (a CUDA graph sizes
    # its grids once for all replays); None: the step's own maximum.
    kv_len_bound: int | None = None
    # The step's MoE exchange between ranks (EP under attention DP): through buffers of this
    # many rows per rank, or (None) sized by the step's counts (``moe_all_to_all``).
    moe_capacity: int | None = None

    # Filled by prepare():
    seq_lens_cpu: torch.Tensor = field(init=False)  # [num_seqs]
    kv_lens_cpu: torch.Tensor = field(init=False)  # [num_seqs]
    cu_seqlens: list[int] = field(init=False)  # [num_seqs + 1]
    position_ids_cpu: torch.Tensor = field(init=False)  # [num_tokens]
    position_ids: torch.Tensor = field(init=False)  # [num_tokens], on device
    # [num_tokens], on device: the sequence each token belongs to
    token_seq_idx: torch.Tensor = field(init=False)
    # On device, int32, for kernels: [num_seqs + 1] query-token offsets, [num_seqs] KV lengths
    # after the step, [num_seqs] positions already cached (the first query token's position).
    cu_seqlens_q: torch.Tensor = field(init=False)
    kv_lens: torch.Tensor = field(init=False)
    num_cached_tokens: torch.Tensor = field(init=False)
    # Inside ``swap_kv_cache_manager`` only: the manager and block table the swap set aside (the
    # step's own; the target's slot table while the draft sub-page view is attached), for kernels
    # that compute sub-page addresses from slot ids. None outside a swap.
    swapped_out: tuple[PagedKVCache, torch.Tensor] | None = field(init=False, default=None)
    _block_offsets: torch.Tensor | None = field(init=False, default=None, repr=False)
    _prefetched: dict[int, torch.Tensor] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if not (len(self.seq_lens) == len(self.num_cached_tokens_per_seq) == n):
            raise ValueError(
                "request_ids, seq_lens and num_cached_tokens_per_seq must have one entry per sequence"
            )
        if not 0 <= self.num_contexts <= n:
            raise ValueError(f"num_contexts={self.num_contexts} out of range for {n} sequences")
        if self.buffers is None:
            self.buffers = MetadataBuffers(self.device)
        self.prepare()

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def tokens_per_block(self) -> int:
        return self.kv_cache_manager.tokens_per_block

    @property
    def max_kv_len(self) -> int:
        """What sizes a launch over the KV: ``kv_len_bound``, else the step's longest sequence."""
        if self.kv_len_bound is not None:
            return self.kv_len_bound
        return int(self.kv_lens_cpu.max()) if self.num_seqs else 0

    @property
    def kv_cache_block_offsets(self) -> torch.Tensor:
        """``[num_pools, num_seqs, 2, max_blocks]`` int32: the attached manager's rows for the batch,
        copied on first use (``_fetch_block_offsets``)."""
        if self._block_offsets is None:
            self._block_offsets = self._fetch_block_offsets(self.kv_cache_manager)
        return self._block_offsets

    def prepare(self) -> None:
        """Derive the per-token tensors and fetch the block table from the attached manager."""
        self.seq_lens_cpu = torch.tensor(self.seq_lens, dtype=torch.long)
        cached = torch.tensor(self.num_cached_tokens_per_seq, dtype=torch.long)
        self.kv_lens_cpu = cached + self.seq_lens_cpu
        self.cu_seqlens = [0]
        for length in self.seq_lens:
            self.cu_seqlens.append(self.cu_seqlens[-1] + length)
        seq_idx_cpu = torch.repeat_interleave(torch.arange(self.num_seqs), self.seq_lens_cpu)
        starts = torch.tensor(self.cu_seqlens[:-1], dtype=torch.long)
        offset_in_seq = torch.arange(self.num_tokens) - starts[seq_idx_cpu]
        self.position_ids_cpu = cached[seq_idx_cpu] + offset_in_seq
        put = self.buffers.put
        self.position_ids = put("position_ids", self.position_ids_cpu, torch.long)
        self.token_seq_idx = put("token_seq_idx", seq_idx_cpu, torch.long)
        self.cu_seqlens_q = put("cu_seqlens_q", torch.tensor(self.cu_seqlens), torch.int32)
        self.kv_lens = put("kv_lens", self.kv_lens_cpu, torch.int32)
        self.num_cached_tokens = put("num_cached_tokens", cached, torch.int32)
        self._prefetched.clear()
        self._block_offsets = self._fetch_block_offsets(self.kv_cache_manager)

    def advance(self) -> None:
        """Every sequence moves one position on (one query token each: a draft chain step). The
        block table stays: the positions must be within the slots already reserved."""
        if self.num_contexts or any(n != 1 for n in self.seq_lens):
            raise ValueError(
                "advance() needs one generation token per sequence; this batch has "
                f"num_contexts={self.num_contexts}, seq_lens={self.seq_lens}"
            )
        self.num_cached_tokens_per_seq = [n + 1 for n in self.num_cached_tokens_per_seq]
        for host in (self.kv_lens_cpu, self.position_ids_cpu):
            host += 1
        for device in (self.kv_lens, self.num_cached_tokens, self.position_ids):
            device += 1

    def place(
        self, first_positions: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None
    ) -> None:
        """Put sequence ``i``'s query tokens at ``first_positions[i]`` onwards (a device tensor), on
        the device tensors only: no host sync, so a CUDA graph can capture it. Without
        ``cu_seqlens_q`` every sequence is a generation step of the same width; with it (a device
        tensor of this metadata's size) the sequences' query lengths are these, each token's
        sequence derived from them, whatever the host lists say (a mixed graph bucket: a prompt of
        any length up to the one the host lists give, beside the decodes). The host copies
        (``kv_lens_cpu``, ``position_ids_cpu``) go stale, so ``kv_len_bound`` must size the launches
        and the backend must read only device metadata (``supports_cuda_graphs``)."""
        if self.kv_len_bound is None:
            raise ValueError("place() needs kv_len_bound: the host kv_lens no longer hold")
        if cu_seqlens_q is not None:
            tokens = torch.arange(self.num_tokens, device=first_positions.device)
            # a token's sequence: how many sequences end at or before it (empty ones included)
            seq_idx = torch.searchsorted(cu_seqlens_q[1:], tokens, right=True)
            self.cu_seqlens_q.copy_(cu_seqlens_q)
            self.token_seq_idx.copy_(seq_idx)
            offsets = tokens - cu_seqlens_q[:-1][seq_idx]
            self.position_ids.copy_(first_positions[seq_idx] + offsets)
            self.num_cached_tokens.copy_(first_positions)
            self.kv_lens.copy_(first_positions + cu_seqlens_q[1:] - cu_seqlens_q[:-1])
            return
        width = self.seq_lens[0] if self.seq_lens else 1
        if self.num_contexts or any(n != width for n in self.seq_lens):
            raise ValueError(
                "place() needs generation steps of one width; this batch has "
                f"num_contexts={self.num_contexts}, seq_lens={self.seq_lens}"
            )
        offsets = torch.arange(width, device=first_positions.device)
        self.position_ids.copy_((first_positions[:, None] + offsets).flatten())
        self.num_cached_tokens.copy_(first_positions)
        self.kv_lens.copy_(first_positions + width)

    def rebind(
        self, request_ids: Sequence[int], copied_from: AttentionMetadata | None = None
    ) -> None:
        """The same batch shape for other sequences: their block table rows are copied into the
        same buffer (or taken from ``copied_from``, a metadata whose first sequences are these,
        in this order, with every table it holds). Positions are left to ``place``."""
        if len(request_ids) != self.num_seqs:
            raise ValueError(
                f"rebind() to {len(request_ids)} sequences; this metadata has {self.num_seqs}"
            )
        self.request_ids = list(request_ids)
        self._prefetched.clear()
        if copied_from is not None:
            self._prefetched.update(copied_from._prefetched)
            self._prefetched[id(copied_from.kv_cache_manager)] = copied_from.kv_cache_block_offsets
        self._block_offsets = self._fetch_block_offsets(self.kv_cache_manager)

    def tensor_addresses(self) -> dict[str, int]:
        """Where each device tensor a step reads lives (a CUDA graph replays only if none moved)."""
        names = ("position_ids", "token_seq_idx", "cu_seqlens_q", "kv_lens", "num_cached_tokens")
        out = {name: getattr(self, name).data_ptr() for name in names}
        out["block_table"] = self.kv_cache_block_offsets.data_ptr()
        out.update({f"block_table/{k}": t.data_ptr() for k, t in self._prefetched.items()})
        return out

    def prefetch_block_offsets(self, manager: PagedKVCache) -> None:
        """Copy ``manager``'s rows now, for a later ``swap_kv_cache_manager(manager)`` to use."""
        self._prefetched[id(manager)] = self._fetch_block_offsets(manager)

    def _fetch_block_offsets(self, manager: PagedKVCache) -> torch.Tensor:
        """``manager``'s rows for the batch, in a buffer of that manager's own (so the target's
        table survives a draft swap); every row is overwritten whole, padding included."""
        if id(manager) in self._prefetched:
            return self._prefetched[id(manager)]
        shape = (manager.num_pools, max(self.num_seqs, 1), 2, manager.max_blocks_per_seq)
        table = self.buffers.take(f"block_table/{id(manager)}", shape, torch.int32)
        if self.num_seqs:
            manager.copy_batch_block_offsets(
                table, self.request_ids, 1, self.num_contexts, self.num_seqs
            )
        else:
            table.zero_()
        return table

    @contextlib.contextmanager
    def swap_kv_cache_manager(self, manager: PagedKVCache | None) -> Iterator[None]:
        """Attend through ``manager`` (and its block table) inside the block; ``None`` keeps the current."""
        if manager is None or manager is self.kv_cache_manager:
            yield
            return
        saved = (self.kv_cache_manager, self.kv_cache_block_offsets, self.swapped_out)
        self.kv_cache_manager = manager
        self.swapped_out = saved[:2]
        self._block_offsets = None  # fetched if read
        try:
            yield
        finally:
            self.kv_cache_manager, self._block_offsets, self.swapped_out = saved

    def seq_token_slice(self, i: int) -> slice:
        return slice(self.cu_seqlens[i], self.cu_seqlens[i + 1])
