"""The same manager with its pools in device memory."""

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.config import (
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests

pytestmark = pytest.mark.gpu


def make(**options):
    """Two target layers and a 4-KV-head draft layer, head_dim 64, bf16, on the GPU."""
    layers = (KvCacheLayer(2, 64), KvCacheLayer(2, 64), KvCacheLayer(4, 64, is_draft=True))
    config = KVCacheManagerV2Config(
        layers=layers,
        max_seq_len=1024,
        max_batch_size=8,
        options=KvCacheOptions(128, "bfloat16", **options),
        max_draft_len=3,
        device="cuda",
    )
    return KVCacheManagerV2(config)


def test_device_pools_views_and_block_offsets():
    mgr = make(max_tokens=128 * 64)
    assert mgr.pools[0].is_cuda and mgr.host_kv_cache_block_offsets.is_pinned()
    draft = mgr.get_buffers(2)
    assert draft.is_cuda and draft.shape == (64, 2, 128, 4, 64)
    assert draft.data_ptr() == mgr.pools[0].data_ptr() + mgr.kv_cache_pool_mapping[2, 1].item()
    reqs = [
        LlmRequest(
            i, list(range(i, i + 100 + 37 * i)), max_new_tokens=4, context_chunk_size=100 + 37 * i
        )
        for i in range(5)
    ]
    mgr.prepare_resources(ScheduledRequests(context_requests=reqs))
    dst = torch.zeros(1, 8, 2, mgr.max_blocks_per_seq, dtype=torch.int32, device="cuda")
    ids = [4, 1, 3, 0, 2]
    mgr.copy_batch_block_offsets(dst, ids, 1, 5, 5)
    torch.cuda.synchronize()
    expect = mgr.host_kv_cache_block_offsets[:, mgr.host_block_table.batch_rows(ids)]
    assert torch.equal(dst[:, :5].cpu(), expect)
    draft[mgr.get_batch_cache_indices([3])[0][0], 0].fill_(1.5)
    assert mgr.pools[0].view(torch.bfloat16).eq(1.5).sum().item() == 128 * 4 * 64
    mgr.shutdown()
    mgr.check_integrity()


def test_pool_sized_from_free_device_memory():
    mgr = make(free_gpu_memory_fraction=0.01)
    free, _ = torch.cuda.mem_get_info()
    slot = mgr.slot_bytes()
    assert mgr.blocks_in_primary_pool * slot <= 0.011 * (free + mgr.pools[0].numel())
    assert mgr.blocks_in_primary_pool > 100
