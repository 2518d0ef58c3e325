"""On a GPU, the bundled model quantized at load to FP8 block scales (``QuantConfig``): its layers
hold FP8 weights, CUDA graphs replay the FP8 kernels with the eager steps' tokens, and it answers
the gsm8k-tiny problems as the bf16 model does."""

import random

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.modules.fp8.block import FP8
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.tasks import gsm8k_tiny, parse_answer
from tensorrt_llm.llmapi import Eagle3DecodingConfig, KvCacheConfig, QuantConfig

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=64, temperature=0)


def run(quant: bool, cuda_graphs: bool):
    llm = LLM(
        device="cuda",
        quant_config=QuantConfig(quant_algo="FP8_BLOCK_SCALES") if quant else None,
        speculative_config=Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(BUNDLED_DRAFT)
        ),
        kv_cache_config=KvCacheConfig(max_tokens=128 * 64),
        **({} if cuda_graphs else {"cuda_graph_config": None}),
    )
    try:
        model = llm.executor.model_engine.model
        fp8_weights = [n for n, p in model.named_parameters() if p.dtype == FP8]
        rng = random.Random(11)
        problems = [gsm8k_tiny(rng) for _ in range(24)]
        prompts = [llm.tokenizer.apply_chat_template(conv[:1]) for conv, _ in problems]
        outputs = llm.generate(prompts, GREEDY)
        if cuda_graphs:
            assert llm.executor.cuda_graph_runner.num_replays > 0
        correct = sum(
            parse_answer(o.outputs[0].text) == answer
            for o, (_, answer) in zip(outputs, problems, strict=True)
        )
        return fp8_weights, [o.outputs[0].token_ids for o in outputs], correct
    finally:
        llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_bundled_model_in_fp8_with_cuda_graphs():
    fp8_weights, eager, correct = run(quant=True, cuda_graphs=False)
    _, graphed, _ = run(quant=True, cuda_graphs=True)
    _, _, bf16_correct = run(quant=False, cuda_graphs=True)
    # q/k/v/o of 4 layers, the dense MLP of layer 0, the experts and shared experts of layers 1-3
    assert len(fp8_weights) == 4 * 4 + 3 + 3 * (2 + 3)
    assert graphed == eager
    assert correct >= bf16_correct - 1 and correct >= 20
