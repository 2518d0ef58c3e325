"""Real MiniMax-M3 KV cache managers for the Triton backend tests, on the test device."""

from __future__ import annotations

import torch
from paged_case import DEVICE

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.pyexecutor.config import (
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
)
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import torch_dtype

TARGET_KV_HEADS, DRAFT_KV_HEADS, HEAD_DIM = 2, 4, 8
DRAFT = 2  # layers 0 (dense) and 1 (sparse: index-K), then the draft layer


def m3_manager(
    tokens_per_block: int = 128, dtype: str = "float16", num_slots: int = 24
) -> MiniMaxM3KVCacheManagerV2:
    """Two target layers of 2 KV heads (layer 1 with an 8-dim index-K) and a draft layer of 4 KV
    heads, head_dim 8, with one-model Eagle3 (max_draft_len 3) in the unified cache."""
    layers = (
        KvCacheLayer(TARGET_KV_HEADS, HEAD_DIM),
        KvCacheLayer(TARGET_KV_HEADS, HEAD_DIM, index_head_dim=8),
        KvCacheLayer(DRAFT_KV_HEADS, HEAD_DIM, is_draft=True),
    )
    config = KVCacheManagerV2Config(
        layers=layers,
        max_seq_len=1024,
        max_batch_size=4,
        options=KvCacheOptions(tokens_per_block, dtype, max_tokens=tokens_per_block * num_slots),
        max_draft_len=3,
        device=str(DEVICE),
    )
    return MiniMaxM3KVCacheManagerV2(config)


def fill_random(manager, generator: torch.Generator) -> None:
    """Random rows in every buffer; in an FP8 cache, random FP8 rows with power-of-two scales (any
    scale is valid; these keep the kernels' products exact, so reads compare tightly; the write
    paths' own scales are read back in ``test_triton_backend.py``)."""
    if manager.dtype != "fp8":
        pool = manager.pools[0].view(torch_dtype(manager.dtype))
        pool.copy_(torch.randn(pool.shape, generator=generator, device=DEVICE))
        return
    pool = manager.pools[0].view(torch.float8_e4m3fn)
    pool.copy_(torch.randn(pool.shape, generator=generator, device=DEVICE).to(pool.dtype))
    for layer in manager.pp_layers:
        scales = list(manager.get_kv_scales(layer))
        if layer in manager.sparse_layer_ids:
            scales.append(manager.get_index_k_scales(layer))
        for s in scales:
            exponents = torch.randint(-3, 3, s.tensor.shape, generator=generator, device=DEVICE)
            s.tensor.copy_(2.0**exponents)


def step_on(
    manager, steps: list[tuple[int, int]], num_contexts: int, seed: int = 0
) -> AttentionMetadata:
    """A step of ``(num_cached, num_new)`` per sequence, the first ``num_contexts`` of them context
    chunks. Allocates each sequence after a throwaway one, so its slots are not 0, 1, 2, ...;
    fills the pool with random values (the cached prefixes)."""
    manager.add_sequence(99, list(range(200)))
    assert manager.resize_sequence(99, 200)
    for rid, (cached, new) in enumerate(steps):
        manager.add_sequence(rid, [rid] * (cached + new))
        assert manager.resize_sequence(rid, cached + new)
    manager.free_sequence(99)
    fill_random(manager, torch.Generator(device=DEVICE).manual_seed(seed))
    return AttentionMetadata(
        manager,
        list(range(len(steps))),
        [new for _, new in steps],
        [cached for cached, _ in steps],
        num_contexts=num_contexts,
        device=DEVICE,
    )
