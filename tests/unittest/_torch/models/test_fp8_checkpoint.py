"""FP8 block-scaled checkpoints (DeepSeek-V3's format, MiniMax-M3's FP8 release) on the CPU: the
weights are dequantized at load, so an FP8 checkpoint decodes exactly as its dequantized twin; the
scales are paired with their weights, partial blocks included (no dimension here is a multiple of
128); ``QuantConfig`` quantizes a bf16 checkpoint at load; bad scales are errors naming them."""

import json
import re

import pytest
import torch
from m3_helpers import tiny_config
from safetensors.torch import load_file, save_file

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.checkpoint import load_model, random_model, save_pretrained
from tensorrt_llm._torch.models.configuration_minimaxm3 import VL_ARCHITECTURE
from tensorrt_llm._torch.modules.fp8.block import FP8, dequantize_weight, quantize_weight
from tensorrt_llm.llmapi import KvCacheConfig, QuantConfig
from tensorrt_llm.quantization import FP8_BLOCK_FORMAT

# What the published FP8 checkpoint quantizes: attention projections, dense MLPs, experts, the
# shared expert; not the router, the indexer, the embedding or the LM head.
QUANTIZED = re.compile(
    r"\.(self_attn\.[qkvo]_proj|(mlp|shared_experts)\.(gate|up|down)_proj|experts\.\d+\.w[123])\.weight$"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(bf16-free fp32 original, fp8, dequantized twin)`` of one tiny published-architecture model
    whose widths are not multiples of 128 (hidden 200, experts of 72, dense MLPs of 136)."""
    root = tmp_path_factory.mktemp("fp8")
    config = tiny_config(
        architectures=[VL_ARCHITECTURE], hidden_size=200, intermediate_size=72,
        shared_intermediate_size=72, dense_intermediate_size=136, head_dim=40,
        index_head_dim=40, vocab_size=96,
    )  # fmt: skip
    model = random_model(config, seed=3, std=0.08)
    save_pretrained(model, config, root / "original")
    fp8_state, twin_state = {}, {}
    for name, tensor in load_file(str(root / "original" / "model.safetensors")).items():
        if QUANTIZED.search(name):
            weight, scale = quantize_weight(tensor)
            fp8_state[name], fp8_state[name + "_scale_inv"] = weight, scale
            twin_state[name] = dequantize_weight(weight, scale)
        else:
            fp8_state[name] = twin_state[name] = tensor
    config_json = json.loads((root / "original" / "config.json").read_text())
    for kind, state in (("fp8", fp8_state), ("twin", twin_state)):
        (root / kind).mkdir()
        save_file(state, str(root / kind / "model.safetensors"))
        data = dict(config_json)
        if kind == "fp8":
            data["quantization_config"] = {
                **FP8_BLOCK_FORMAT,
                "modules_to_not_convert": ["lm_head"],
            }
        (root / kind / "config.json").write_text(json.dumps(data))
    return root, len([n for n in fp8_state if n.endswith("_scale_inv")])


def test_the_fixture_quantizes_every_layer_kind(checkpoints):
    root, num_scales = checkpoints
    names = load_file(str(root / "fp8" / "model.safetensors"))
    assert names["language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"].dtype == FP8
    assert names["language_model.model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    assert num_scales == 3 * 4 + 2 * 3 + 4 * 3 + 3  # attention, dense MLPs, experts, shared


def test_an_fp8_checkpoint_loads_as_its_dequantized_twin_on_the_cpu(checkpoints):
    root, _ = checkpoints
    fp8, twin = load_model(root / "fp8"), load_model(root / "twin")
    original = load_model(root / "original")
    assert fp8.config.quant_algo == "FP8_BLOCK_SCALES"
    for name, tensor in twin.state_dict().items():
        assert torch.equal(fp8.state_dict()[name], tensor), name
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(fp8.state_dict()[q_proj], original.state_dict()[q_proj])  # quantized


def greedy(model_dir, **kwargs):
    llm = LLM(
        model_dir, skip_tokenizer_init=True, device="cpu", dtype="float32",
        kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=1024), **kwargs,
    )  # fmt: skip
    try:
        prompts = [[(7 * i + j) % 90 + 1 for j in range(40 + 23 * i)] for i in range(3)]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def test_an_fp8_checkpoint_decodes_as_its_dequantized_twin(checkpoints):
    root, _ = checkpoints
    assert greedy(root / "fp8") == greedy(root / "twin")


def test_quant_config_rounds_a_checkpoint_to_the_fp8_grid_at_load(checkpoints):
    root, _ = checkpoints
    at_load = load_model(root / "original", quant_algo="FP8_BLOCK_SCALES")
    twin = load_model(root / "twin")
    for name, tensor in twin.state_dict().items():
        assert torch.equal(at_load.state_dict()[name], tensor), name
    assert greedy(
        root / "original", quant_config=QuantConfig(quant_algo="FP8_BLOCK_SCALES")
    ) == greedy(root / "twin")


def test_a_scale_of_the_wrong_shape_is_an_error_naming_the_weight(checkpoints, tmp_path):
    root, _ = checkpoints
    state = load_file(str(root / "fp8" / "model.safetensors"))
    name = "language_model.model.layers.2.mlp.down_proj.weight"
    state[name + "_scale_inv"] = state[name + "_scale_inv"][:, :1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((root / "fp8" / "config.json").read_text())
    with pytest.raises(
        ValueError, match=rf"{re.escape(name)}: weight_scale_inv \(2, 1\) does not fit"
    ):
        load_model(tmp_path)


def test_a_scale_without_its_weight_is_unexpected(checkpoints, tmp_path):
    root, _ = checkpoints
    state = load_file(str(root / "fp8" / "model.safetensors"))
    state["language_model.model.layers.0.self_attn.z_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((root / "fp8" / "config.json").read_text())
    with pytest.raises(
        ValueError, match=r"1 unexpected tensor\(s\) \['language_model.*z_proj.weight_scale_inv'\]"
    ):
        load_model(tmp_path)
