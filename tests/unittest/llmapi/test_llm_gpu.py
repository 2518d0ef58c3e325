"""The same end-to-end checks with the model and the KV pools on a GPU."""

import pytest
import torch
from test_llm import GREEDY, PROMPTS

from tensorrt_llm import LLM
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import PADDING_REQUEST_ID
from tensorrt_llm.llmapi.llm_args import KvCacheConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_equals_alone_on_gpu(tiny_checkpoint, dtype):
    def make():
        return LLM(
            tiny_checkpoint,
            device="cuda",
            dtype=dtype,
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=4096),
        )

    llm = make()
    assert llm.kv_cache_manager.pools[0].is_cuda
    # before any request: with CUDA graphs (the default here) only the padding sequence holds
    # slots, the positions of the largest mixed graph's padding (within one sequence's)
    held = llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"]
    runner = llm.executor.cuda_graph_runner
    assert runner is not None
    padding = llm.kv_cache_manager.get_cache(PADDING_REQUEST_ID).num_blocks
    assert held == padding == -(-runner.shapes.padding_positions // 8)
    batched = llm.generate(PROMPTS, GREEDY)
    cpu = LLM(
        tiny_checkpoint,
        device="cpu",
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=4096),
    )
    for prompt, out in zip(PROMPTS, batched):
        alone = make().generate(prompt, GREEDY)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        if dtype == "float32":
            reference = cpu.generate(prompt, GREEDY)
            torch.testing.assert_close(
                out.outputs[0].generation_logits,
                reference.outputs[0].generation_logits,
                rtol=1e-3,
                atol=1e-3,
            )
    assert llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == held  # nothing leaked


@pytest.mark.parametrize("mode", ["unified", "separate"])
def test_greedy_speculation_on_gpu_is_token_identical(spec_checkpoints, mode):
    from test_llm_eagle3 import GREEDY as SPEC_GREEDY
    from test_llm_eagle3 import LONG, PREFIX, SHORT, make, tokens

    prompts = SHORT + LONG + [PREFIX + "x", PREFIX + "y"]
    expected = tokens(make(spec_checkpoints, device="cuda").generate(prompts, SPEC_GREEDY))
    llm = make(spec_checkpoints, mode, device="cuda")
    assert tokens(llm.generate(prompts, SPEC_GREEDY)) == expected
    if mode == "unified":
        view = llm.kv_cache_manager.draft_subpage_view
        assert view.get_kv_pages(view.draft_layer_ids[0])[0].is_cuda


def test_a_separate_draft_manager_shares_the_memory_fraction(spec_checkpoints):
    """Sized from free GPU memory, the target and the separate draft manager together stay within
    free_gpu_memory_fraction (the draft gets as many slots as the target)."""
    from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig

    target, draft = spec_checkpoints
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    llm = LLM(
        target,
        device="cuda",
        kv_cache_config=KvCacheConfig(tokens_per_block=8, free_gpu_memory_fraction=0.05),
        speculative_config=Eagle3DecodingConfig(
            speculative_model=str(draft), draft_kv_cache="separate"
        ),
    )
    managers = llm.executor.resource_manager.kv_cache_managers.values()
    pool_bytes = sum(pool.numel() * pool.element_size() for m in managers for pool in m.pools)
    assert pool_bytes <= 0.05 * free_before
    assert pool_bytes >= 0.04 * free_before  # and the budget is used, not halved
    draft = [m for m in managers if m.is_draft][0]
    assert draft.blocks_in_primary_pool == llm.kv_cache_manager.blocks_in_primary_pool


def test_shutdown_gives_the_device_memory_back_for_the_next_llm(tiny_checkpoint):
    """The KV pool takes its share of the free memory; after ``shutdown`` less than 1% of what
    the LLM held is still allocated, and a second LLM gets as many slots as the first."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    first = LLM(tiny_checkpoint, device="cuda")
    held = torch.cuda.memory_allocated() - base
    slots = first.kv_cache_manager.blocks_in_primary_pool
    first.generate(PROMPTS, GREEDY)
    first.shutdown()
    assert torch.cuda.memory_allocated() - base < 0.01 * held
    with LLM(tiny_checkpoint, device="cuda") as second:
        assert second.kv_cache_manager.blocks_in_primary_pool >= 0.98 * slots
        assert second.generate(PROMPTS[0], GREEDY).outputs[0].token_ids
    assert torch.cuda.memory_allocated() - base < 0.01 * held
