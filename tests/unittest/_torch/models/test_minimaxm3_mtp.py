"""MiniMax-M3's MTP module (``modeling_minimaxm3_mtp.py``) against a reference written from the
published description (Gemma RMSNorm of the embedding of token t+1, zero at position 0, and of the
target's final hidden state; ``eh_proj`` of the two, the embedding first; a sparse-attention MoE
decoder layer; the final norm before the target's LM head), and its loading from the hub's keys.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from tensorrt_llm._torch.models.checkpoint import load_model, random_model, save_pretrained
from tensorrt_llm._torch.models.checkpoint_minimaxm3 import MiniMaxM3CheckpointLayout
from tensorrt_llm._torch.modules.moe import MiniMaxM3SparseMoeBlock
from tensorrt_llm._torch.training import use_training_backend

sys.path.insert(0, str(Path(__file__).parents[1]))
from m3_helpers import tiny_config  # noqa: E402


def gemma_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, in fp32: ``x / rms(x) * (1 + weight)``."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(num_mtp_modules=1)
    return random_model(cfg, seed=3, std=0.15, num_mtp_modules=1)


def reference(model, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
    """The module from the description, its layer run as a target layer is."""
    cfg, mtp = model.config, model.model.mtp.layers[0]
    eps = cfg.rms_norm_eps
    following = torch.roll(ids, -1, dims=-1)  # token t + 1 at position t
    embedded = model.model.embed_tokens(following)
    embedded = embedded * (positions != 0).unsqueeze(-1)
    fused = torch.cat(
        [gemma_rms(embedded, mtp.enorm.weight, eps), gemma_rms(hidden, mtp.hnorm.weight, eps)], -1
    )
    x = fused @ mtp.eh_proj.weight.T
    h = mtp.transformer_layer(x, positions, None, model.attn_backend)
    logits = gemma_rms(h, mtp.final_layernorm.weight, eps) @ model.lm_head.weight.T
    return h, logits.float()


def test_the_module_is_the_published_description(model):
    cfg = model.config
    mtp = model.model.mtp.layers[0]
    layer = mtp.transformer_layer
    # one more sparse layer of the target's geometry, with an MoE, after the target's layers
    assert mtp.layer_idx == cfg.num_hidden_layers
    assert layer.self_attn.is_sparse and layer.self_attn.layer_idx == cfg.num_hidden_layers
    assert isinstance(layer.mlp, MiniMaxM3SparseMoeBlock)
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), use_training_backend(model):
        hidden, _ = model(ids)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        following = torch.roll(ids, -1, dims=-1)
        got = model.mtp_hidden(following, hidden, positions)
        want, want_logits = reference(model, ids, hidden, positions)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(model.mtp_logits(got), want_logits, rtol=1e-6, atol=1e-6)
        # the embedding first: the halves swapped give another result
        mtp = model.model.mtp.layers[0]
        swapped = mtp.eh_proj(
            torch.cat([mtp.hnorm(hidden), mtp.enorm(model.model.embed_tokens(following))], -1)
        )
        assert not torch.allclose(
            mtp.transformer_layer(swapped, positions, None, model.attn_backend), got
        )


def test_the_hub_keys_load_into_the_module_and_are_skipped_without_it(model, tmp_path):
    save_pretrained(model, model.config, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    prefix = "language_model.model.mtp.layers.0."
    assert prefix + "eh_proj.weight" in names
    assert prefix + "transformer_layer.block_sparse_moe.experts.0.w1.weight" in names
    assert prefix + "transformer_layer.self_attn.index_k_proj.weight" in names
    loaded = load_model(tmp_path, torch.float32, num_mtp_modules=1)
    for (name, want), (_, got) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(want, got), name
    plain = load_model(tmp_path, torch.float32)  # the target alone: the module's keys skipped
    assert not hasattr(plain.model, "mtp")
    assert MiniMaxM3CheckpointLayout.skipped_family(prefix + "eh_proj.weight", plain) == "mtp"


def test_asking_for_mtp_without_its_weights_names_what_is_missing(tmp_path):
    cfg = tiny_config()
    save_pretrained(random_model(cfg, seed=1), cfg, tmp_path / "plain")
    with pytest.raises(ValueError, match="num_mtp_modules=0"):
        load_model(tmp_path / "plain", torch.float32, num_mtp_modules=1)
    cfg = tiny_config(num_mtp_modules=1)  # a config that says so, but no weights
    save_pretrained(random_model(cfg, seed=1), cfg, tmp_path / "no_weights")
    with pytest.raises(ValueError, match=r"missing tensor\(s\).*mtp\.layers\.0"):
        load_model(tmp_path / "no_weights", torch.float32, num_mtp_modules=1)


def test_the_module_layer_is_one_more_sparse_layer_in_the_target_slots():
    """Unified: the MTP layer's K, V and index-K are whole pages of the target's slots (no
    sub-page view: the drafter attends the target manager); a draft layer with index-K of
    another geometry is refused, naming the layers."""
    from m3_helpers import executor_config

    from tensorrt_llm._torch.models.modeling_minimaxm3_mtp import mtp_layer_config
    from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
    from tensorrt_llm._torch.pyexecutor.resource_manager import (
        ResourceManager,
        ResourceManagerType,
    )
    from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig
    from tensorrt_llm._torch.speculative.utils import WHOLE_PAGE_MODE, resolve_draft_kv

    cfg = tiny_config(num_mtp_modules=1)
    mtp_layer = mtp_layer_config(cfg, 1).kv_cache_layers()[-1]
    spec = Eagle3SpecConfig(max_draft_len=3, speculative_model="")
    managers = create_kv_cache_managers(cfg, executor_config(spec=spec), mtp_layer)
    target = managers[ResourceManagerType.KV_CACHE_MANAGER]
    assert set(managers) == {ResourceManagerType.KV_CACHE_MANAGER}
    assert target.local_draft_layer_ids == (cfg.num_hidden_layers,)
    assert target.whole_page_draft and target.draft_subpage_view is None
    assert cfg.num_hidden_layers in target.sparse_layer_ids
    assert resolve_draft_kv(ResourceManager(managers)) == (None, WHOLE_PAGE_MODE)
    wrong = dataclasses.replace(mtp_layer, index_head_dim=mtp_layer.index_head_dim * 2)
    with pytest.raises(ValueError, match=rf"draft layers \[{cfg.num_hidden_layers}\]"):
        create_kv_cache_managers(cfg, executor_config(spec=spec), wrong)


def test_an_fp8_block_scaled_module_loads_as_its_dequantized_twin(tmp_path):
    """An FP8 build's module (its projections, experts and ``eh_proj`` with ``weight_scale_inv``)
    loads on the CPU as the same module dequantized."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    from tensorrt_llm._torch.modules.fp8.block import dequantize_weight, quantize_weight
    from tensorrt_llm.quantization import FP8_BLOCK_FORMAT

    quantized = re.compile(
        r"\.(eh_proj|self_attn\.[qkvo]_proj|(mlp|shared_experts)\.(gate|up|down)_proj"
        r"|experts\.\d+\.w[123])\.weight$"
    )
    cfg = tiny_config(num_mtp_modules=1)
    save_pretrained(random_model(cfg, seed=4, std=0.1, num_mtp_modules=1), cfg, tmp_path / "bf16")
    fp8, twin = {}, {}
    for name, tensor in load_file(str(tmp_path / "bf16" / "model.safetensors")).items():
        if quantized.search(name):
            weight, scale = quantize_weight(tensor)
            fp8[name], fp8[name + "_scale_inv"] = weight, scale
            twin[name] = dequantize_weight(weight, scale)
        else:
            fp8[name] = twin[name] = tensor
    assert "language_model.model.mtp.layers.0.eh_proj.weight_scale_inv" in fp8
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    for kind, state in (("fp8", fp8), ("twin", twin)):
        (tmp_path / kind).mkdir()
        save_file(state, str(tmp_path / kind / "model.safetensors"))
        quant = {"quantization_config": {**FP8_BLOCK_FORMAT, "modules_to_not_convert": ["lm_head"]}}
        data = {**config, **(quant if kind == "fp8" else {})}
        (tmp_path / kind / "config.json").write_text(json.dumps(data))
    got = load_model(tmp_path / "fp8", torch.float32, num_mtp_modules=1).state_dict()
    want = load_model(tmp_path / "twin", torch.float32, num_mtp_modules=1).state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
