"""The public Triton attention ops: argument checks, the split-K choice, then a launcher.

Each op has a torch reference with the same meaning in ``attention_backend/reference.py``
(``write_paged``; ``gather_paged`` + ``causal_attention``), which the tests hold it to.
"""

from __future__ import annotations

import functools

import torch
import triton

from tensorrt_llm._torch.attention_backend.triton.addressing import PagedKV
from tensorrt_llm._torch.attention_backend.triton.launch import (
    attention_tiles,
    is_interpreted,
    launch_kv_write,
    launch_paged_attention,
)
from tensorrt_llm._torch.attention_backend.triton.step import StepBatch

MIN_KV_PER_SPLIT = 256  # a split reads at least this many keys (else its setup dominates)
MAX_SPLITS = 64
PROGRAMS_PER_SM = 8
# Dense decode: splits of 128-key tiles, about 2 programs per SM (on an H200, 8 x 32K of the draft
# geometry through the view in 8 splits: 0.95 of SDPA; benchmarks/bench_attention.py)
DECODE_PROGRAMS_PER_SM = 2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def write_kv_pages(
    k: torch.Tensor,
    v: torch.Tensor | None,
    kv: PagedKV,
    position_ids: torch.Tensor,
    token_seq_idx: torch.Tensor,
) -> None:
    """Store token ``t``'s ``k[t], v[t]`` (``[num_tokens, num_kv_heads, head_dim]``) at KV position
    ``position_ids[t]`` of sequence ``token_seq_idx[t]`` through ``kv``'s table and addressing, in
    one launch for K and V (no host sync). ``v`` None: K alone (lane 0), as index-K is written."""
    if k.dim() != 3 or (v is not None and k.shape != v.shape):
        raise ValueError(
            f"k {tuple(k.shape)} and v {None if v is None else tuple(v.shape)} must both be "
            "[num_tokens, num_kv_heads, head_dim]"
        )
    if k.shape[1:] != kv.k_pages.shape[2:]:
        raise ValueError(
            f"k has (num_kv_heads, head_dim)={tuple(k.shape[1:])} but the pages hold "
            f"{tuple(kv.k_pages.shape[2:])}"
        )
    for name, t in (("position_ids", position_ids), ("token_seq_idx", token_seq_idx)):
        if t.shape != (k.shape[0],):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({k.shape[0]},)")
    values = (k,) if v is None else (k, v)
    _check_device(*values, kv.k_pages, kv.v_pages, kv.block_table, position_ids, token_seq_idx)
    launch_kv_write(k, v, kv, position_ids, token_seq_idx)


def paged_attention(
    q: torch.Tensor,
    kv: PagedKV,
    batch: StepBatch,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query token to its sequence's cached keys (positions ``<=`` its
    own).

    q: ``[num_tokens, num_heads, head_dim]`` (tokens ordered as ``batch.cu_seqlens_q``),
    ``num_heads`` a multiple of ``kv.num_kv_heads``; returns ``[num_tokens, num_heads, head_dim]``
    in q's dtype.
    Scores ``q . k * scale`` and the softmax are fp32. ``num_splits``: KV partitions per sequence
    (flash decoding); ``None`` chooses from the shape (``choose_num_splits``).
    """
    if q.dim() != 3 or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype} must be [num_tokens, num_heads, head_dim] in "
            f"{[str(d) for d in SUPPORTED_DTYPES]}"
        )
    num_heads, head_dim = q.shape[1:]
    if head_dim != kv.head_dim or num_heads % kv.num_kv_heads:
        raise ValueError(
            f"q has num_heads={num_heads}, head_dim={head_dim}; the pages hold "
            f"num_kv_heads={kv.num_kv_heads}, head_dim={kv.head_dim} (num_heads must be a multiple)"
        )
    if batch.num_seqs > kv.block_table.shape[0]:
        raise ValueError(
            f"the batch has {batch.num_seqs} sequences but the block table "
            f"{kv.block_table.shape[0]} rows"
        )
    _check_device(q, kv.k_pages, kv.v_pages, kv.block_table, batch.cu_seqlens_q, batch.kv_lens)
    if num_splits is None:
        num_splits = paged_attention_num_splits(q, kv, batch)
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be a positive int")
    group = num_heads // kv.num_kv_heads
    split = num_splits > 1
    tiles = attention_tiles(batch.max_query_len, group, head_dim, q.element_size(), split)
    return launch_paged_attention(q, kv, batch, scale, num_splits, tiles)


def choose_num_splits(
    num_programs: int,
    max_kv_len: int,
    num_sms: int,
    programs_per_sm: int = PROGRAMS_PER_SM,
    max_splits: int = MAX_SPLITS,
) -> int:
    """KV partitions per sequence for a launch of ``num_programs`` (sequences x query tiles x KV
    heads) on ``num_sms`` multiprocessors.

    Enough splits for about ``programs_per_sm`` programs per multiprocessor, but never a split of
    fewer than ``MIN_KV_PER_SPLIT`` keys and never more than ``MAX_SPLITS``; 1 when the launch
    already fills the device. So prefill and large decode batches run unsplit, and a long-context
    decode at small batch is spread across the GPU (on an H200, one 32k-token sequence of 8 KV
    heads: 2.2 TB/s of KV read with 32 to 64 splits against 0.15 TB/s unsplit; 8 sequences of 8k
    with 1 + 3 query tokens: 3.1 TB/s with 8 splits against 1.1 unsplit).
    """
    if num_programs >= num_sms:
        return 1
    wanted = triton.cdiv(programs_per_sm * num_sms, max(num_programs, 1))
    return max(1, min(wanted, triton.cdiv(max_kv_len, MIN_KV_PER_SPLIT), max_splits))


def decode_num_splits(num_programs: int, max_kv_len: int, num_sms: int) -> int:
    """``choose_num_splits`` at ``DECODE_PROGRAMS_PER_SM``, rounded down to a power of two (a
    long context then splits into equal runs of whole 128-key tiles). FP8 pages take the same
    count (twice as many splits of half the bytes each were slower on an H100;
    ``bench_decode_kernels.py --splits`` compares counts)."""
    wanted = choose_num_splits(num_programs, max_kv_len, num_sms, DECODE_PROGRAMS_PER_SM)
    return 1 << (wanted.bit_length() - 1)


def paged_attention_num_splits(q: torch.Tensor, kv: PagedKV, batch: StepBatch) -> int:
    """The KV splits ``paged_attention`` takes for ``q`` over ``kv`` when not told."""
    num_heads, head_dim = q.shape[1:]
    group = num_heads // kv.num_kv_heads
    tiles = attention_tiles(batch.max_query_len, group, head_dim, q.element_size())
    num_programs = batch.num_seqs * tiles.num_query_tiles * kv.num_kv_heads
    return decode_num_splits(num_programs, batch.max_kv_len, num_sms(q.device))


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"the op's tensors are on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not is_interpreted():
        raise ValueError(
            f"Triton kernels need CUDA tensors; these are on {device}. On a CPU, set "
            "TRITON_INTERPRET=1 before tensorrt_llm's Triton kernels are imported"
        )
