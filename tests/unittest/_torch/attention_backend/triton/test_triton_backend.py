"""``attn_backend="TRITON"``: selected by name, and equal to ``VANILLA`` (the torch reference) on a
real MiniMax-M3 cache, for dense and MSA layers, over a prefill step and a mixed step."""

import sys

import pytest
import torch

pytest.importorskip("triton.language")

from m3_cache import HEAD_DIM, TARGET_KV_HEADS, m3_manager  # noqa: E402
from paged_case import DEVICE  # noqa: E402

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (  # noqa: E402
    MsaConfig,
    MsaInputs,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa_backend import (  # noqa: E402
    TritonMsaBackend,
    VanillaMsaBackend,
    msa_backend_for,
)
from tensorrt_llm._torch.attention_backend.triton import ops  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton.backend import (  # noqa: E402
    TritonAttentionBackend,
)
from tensorrt_llm._torch.attention_backend.utils import get_attention_backend  # noqa: E402
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend  # noqa: E402

NUM_HEADS = 2 * TARGET_KV_HEADS  # GQA 2
SCALE = HEAD_DIM**-0.5
# one index head per KV group; 16-token key blocks, 2 of them per query (its own forced)
MSA = MsaConfig(TARGET_KV_HEADS, index_head_dim=8, block_size=16, topk_blocks=2, local_blocks=1)
# (cached, new) per sequence: a prefill step (two prompts, one chunk of a longer one), then a mixed
# step (the long prompt's next chunk, then 1 + 3 token decodes of the other two)
STEP_1 = [(0, 45), (0, 3), (0, 40)]
STEP_2 = [(40, 30), (45, 4), (3, 4)]
NUM_CONTEXTS = (3, 1)


def test_triton_is_selected_by_name():
    backend = get_attention_backend("TRITON")
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "TRITON"


def test_without_triton_the_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(ValueError, match="attn_backend='TRITON' needs the triton package"):
        get_attention_backend("TRITON")


def test_each_backend_has_its_msa_backend():
    vanilla, triton_backend = VanillaAttentionBackend(), TritonAttentionBackend()
    assert isinstance(msa_backend_for(vanilla), VanillaMsaBackend)
    assert isinstance(msa_backend_for(triton_backend), TritonMsaBackend)
    assert msa_backend_for(triton_backend) is msa_backend_for(triton_backend)  # made once
    assert msa_backend_for(triton_backend).attn_backend is triton_backend


def test_attention_needs_metadata():
    q = torch.zeros(1, NUM_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="attn_backend='TRITON' .* needs attn_metadata"):
        TritonAttentionBackend().attention(0, q, q, q, None, SCALE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors without the interpreter")
def test_cpu_tensors_without_the_interpreter_are_a_clear_error(monkeypatch):
    monkeypatch.setattr(ops, "is_interpreted", lambda: False)
    k = torch.zeros(2, TARGET_KV_HEADS, HEAD_DIM)
    manager = m3_manager(tokens_per_block=32, dtype="float32")
    manager.add_sequence(0, [1, 2])
    manager.resize_sequence(0, 2)
    md = AttentionMetadata(manager, [0], [2], [0], num_contexts=1)
    with pytest.raises(ValueError, match="need CUDA tensors; these are on cpu.*TRITON_INTERPRET=1"):
        TritonAttentionBackend().attention(0, k.repeat(1, 2, 1), k, k, md, SCALE)


def step(manager, steps, num_contexts):
    for rid, (cached, new) in enumerate(steps):
        if cached == 0:
            manager.add_sequence(rid, [rid] * (cached + new))
        assert manager.resize_sequence(rid, cached + new)
    return AttentionMetadata(
        manager,
        list(range(len(steps))),
        [new for _, new in steps],
        [cached for cached, _ in steps],
        num_contexts,
        device=DEVICE,
    )


def inputs(num_tokens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(NUM_HEADS, HEAD_DIM), (TARGET_KV_HEADS, HEAD_DIM), (TARGET_KV_HEADS, HEAD_DIM)]
    shapes += [(TARGET_KV_HEADS, MSA.index_head_dim), (1, MSA.index_head_dim)]  # index q, k
    return [torch.randn(num_tokens, *s, generator=g).to(dtype).to(DEVICE) for s in shapes]


@pytest.mark.parametrize(
    "layer, tokens_per_block, dtype",
    [
        (0, 32, "float32"),
        (0, 64, "bfloat16"),
        (1, 16, "float32"),
        (1, 128, "bfloat16"),
        (0, 32, "fp8"),
        (1, 16, "fp8"),
    ],
)
def test_two_steps_equal_vanilla(layer, tokens_per_block, dtype):
    """Layer 0 is dense, layer 1 MSA through ``msa_backend_for(backend)`` (16-token key blocks,
    top-2 per KV group: a real selection past 32 tokens, so MSA is not dense attention). FP8: a
    bf16 model over an FP8 cache, whose rows and scales both backends write bit for bit alike."""
    tol = 2e-5 if dtype == "float32" else 2e-2
    model_dtype = torch.bfloat16 if dtype == "fp8" else getattr(torch, dtype)
    managers = [m3_manager(tokens_per_block, dtype) for _ in range(2)]
    for seed, (steps, num_contexts) in enumerate(zip((STEP_1, STEP_2), NUM_CONTEXTS)):
        outs = []
        for manager, backend in zip(
            managers, (VanillaAttentionBackend(), TritonAttentionBackend())
        ):
            md = step(manager, steps, num_contexts)
            q, k, v, iq, ik = inputs(md.num_tokens, model_dtype, seed)
            if layer == 0:
                outs.append(backend.attention(layer, q, k, v, md, SCALE))
            else:
                msa = MsaInputs(index_q=iq, index_k=ik)
                outs.append(msa_backend_for(backend).attend(layer, q, k, v, msa, md, MSA, SCALE))
                # dense attention over the same cache (its writes store the same K and V again)
                dense = backend.attention(layer, q, k, v, md, SCALE)
                assert not torch.allclose(outs[-1].float(), dense.float(), rtol=0.1, atol=0.1)
        assert torch.equal(managers[0].pools[0], managers[1].pools[0])  # the same bytes written
        torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=tol, atol=tol)
