"""``load_format="dummy"`` (upstream's key): a model and its drafter from their configs alone, random
weights made on the device, for benchmarks of models whose files are not at hand."""

import shutil

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.checkpoint import load_config, load_model
from tensorrt_llm._torch.modules.fp8.block import dequantize_weight, quantize_weight
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.llmapi import Eagle3DecodingConfig, KvCacheConfig


@pytest.fixture
def configs_only(tmp_path):
    """The bundled target's and drafter's config.json, without their weights."""
    for src, name in ((BUNDLED_TARGET, "target"), (BUNDLED_DRAFT, "eagle3")):
        (tmp_path / name).mkdir()
        shutil.copy(src / "config.json", tmp_path / name / "config.json")
    return tmp_path / "target", tmp_path / "eagle3"


def test_without_weight_files_only_dummy_loads(configs_only):
    target, _ = configs_only
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(target)
    model = load_model(target, load_format="dummy")
    norm = model.model.norm
    assert torch.equal(norm.weight + norm.weight_offset, torch.ones_like(norm.weight))
    q = model.model.layers[0].self_attn.q_proj.weight
    assert 0.015 < q.std().item() < 0.025  # N(0, 0.02)
    with pytest.raises(ValueError, match=r"load_format='npz'; expected one of \('auto', 'dummy'\)"):
        load_model(target, load_format="npz")


def test_dummy_fp8_weights_are_on_the_fp8_grid_on_the_cpu(configs_only):
    target, _ = configs_only
    model = load_model(target, torch.float32, load_format="dummy", quant_algo="FP8_BLOCK_SCALES")
    for weight in (
        model.model.layers[0].self_attn.o_proj.weight,
        model.model.layers[1].mlp.experts.w13[3, :128],
    ):
        assert torch.equal(dequantize_weight(*quantize_weight(weight)), weight)
        assert weight.std() > 0.01


def test_an_llm_with_an_eagle3_drafter_runs_on_dummy_weights(configs_only):
    target, eagle3 = configs_only
    vocab_size = load_config(target).vocab_size
    llm = LLM(
        target,
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        kv_cache_config=KvCacheConfig(max_tokens=1024),
        speculative_config=Eagle3DecodingConfig(max_draft_len=3, speculative_model=str(eagle3)),
    )
    try:
        outputs = llm.generate([[5, 6, 7, 8] * 10], SamplingParams(max_tokens=8, ignore_eos=True))
        tokens = outputs[0].outputs[0].token_ids
        assert len(tokens) == 8 and all(0 <= t < vocab_size for t in tokens)
    finally:
        llm.shutdown()
