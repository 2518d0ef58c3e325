"""``attn_backend``: None picks the device's backend, and TRITON generates what VANILLA generates.

On a CPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, read when the kernel
modules are imported, so it is set at collection, before any LLM below builds its model).
"""

import os

import pytest
import torch
from test_llm import PROMPTS

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend
from tensorrt_llm.llmapi.llm_args import KvCacheConfig, default_attn_backend

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_llm(ckpt, device="cpu", **kwargs):
    kv = KvCacheConfig(tokens_per_block=8, max_tokens=1024)
    return LLM(ckpt, kv_cache_config=kv, max_batch_size=4, device=device, **kwargs)


def test_no_attn_backend_means_triton_on_cuda_and_vanilla_on_the_cpu(tiny_checkpoint):
    assert default_attn_backend("cuda") == default_attn_backend("cuda:1") == "TRITON"
    assert default_attn_backend("cpu") == "VANILLA"
    llm = make_llm(tiny_checkpoint)
    assert llm.args.attn_backend == "VANILLA"
    assert isinstance(llm.model.attn_backend, VanillaAttentionBackend)


def test_triton_generates_what_vanilla_generates(tiny_checkpoint):
    pytest.importorskip("triton.language")
    greedy = SamplingParams(max_tokens=5, ignore_eos=True, return_generation_logits=True)
    prompts = PROMPTS[:3]  # 2, 110 and 15 tokens: a batch of prefill chunks, then decodes
    outputs = {}
    for backend in ("VANILLA", "TRITON"):
        llm = make_llm(tiny_checkpoint, DEVICE, dtype="float32", attn_backend=backend)
        assert llm.model.attn_backend.name == backend
        outputs[backend] = [out.outputs[0] for out in llm.generate(prompts, greedy)]
    for vanilla, triton in zip(outputs["VANILLA"], outputs["TRITON"]):
        assert triton.token_ids == vanilla.token_ids and len(triton.token_ids) == 5
        torch.testing.assert_close(
            triton.generation_logits, vanilla.generation_logits, rtol=1e-4, atol=1e-4
        )
