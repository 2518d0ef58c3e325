"""The same end-to-end checks with the model and the KV pools on a GPU."""

import pytest
import torch
from test_llm import GREEDY, PROMPTS

from tensorrt_llm import LLM
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
    assert llm.kv_cache_manager.get_kv_cache_stats().num_used_slots == 0


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
