"""Models by architecture: config.json's architectures[0] picks the classes; a new architecture is one
registry entry; an unknown one is a clear error."""

import json
from types import SimpleNamespace

import pytest
import torch
from m3_helpers import tiny_config

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend
from tensorrt_llm._torch.models.checkpoint import (
    load_config,
    load_eagle3,
    load_model,
    random_model,
    save_pretrained,
)
from tensorrt_llm._torch.models.configuration_minimaxm3 import MiniMaxM3Config
from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3ForCausalLM
from tensorrt_llm._torch.models.registry import MODEL_REGISTRY, ModelClasses, get_model_classes
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET


class ThrowawayConfig(MiniMaxM3Config):
    pass


class ThrowawayForCausalLM(MiniMaxM3ForCausalLM):
    pass


class ThrowawayKVCacheManager(MiniMaxM3KVCacheManagerV2):
    pass


def test_the_published_architectures_are_one_m3_with_its_config_model_and_kv_cache_manager():
    m3 = ModelClasses(MiniMaxM3Config, MiniMaxM3ForCausalLM, MiniMaxM3KVCacheManagerV2)
    assert get_model_classes("MiniMaxM3SparseForConditionalGeneration") == m3  # the hub's VL
    assert get_model_classes("MiniMaxM3VLForCausalLM") == m3  # transformers' text-only save
    assert sorted(MODEL_REGISTRY) == [
        "MiniMaxM3SparseForConditionalGeneration",
        "MiniMaxM3VLForCausalLM",
    ]


def test_the_bundled_checkpoint_loads_strictly_by_its_architecture():
    model = load_model(BUNDLED_TARGET)
    assert type(model) is MiniMaxM3ForCausalLM and type(model.config) is MiniMaxM3Config
    assert model.config == load_config(BUNDLED_TARGET)
    assert isinstance(model.attn_backend, VanillaAttentionBackend) and not model.training
    assert model.lm_head.weight.dtype == torch.bfloat16  # the config's torch_dtype
    draft = load_eagle3(BUNDLED_DRAFT, model, layer_idx=model.config.num_hidden_layers)
    assert draft.embed_tokens is model.model.embed_tokens
    assert draft.fc.weight.dtype == torch.bfloat16


def test_a_registered_architecture_dispatches_to_its_own_classes(tmp_path, monkeypatch):
    classes = ModelClasses(ThrowawayConfig, ThrowawayForCausalLM, ThrowawayKVCacheManager)
    monkeypatch.setitem(MODEL_REGISTRY, "ThrowawayForCausalLM", classes)
    config = ThrowawayConfig.from_dict(
        {**tiny_config().to_dict(), "architectures": ["ThrowawayForCausalLM"]}
    )
    model = random_model(config, seed=3)
    assert type(model) is ThrowawayForCausalLM
    save_pretrained(model, config, tmp_path)

    loaded = load_model(tmp_path, dtype=torch.float32)
    assert type(loaded) is ThrowawayForCausalLM and type(loaded.config) is ThrowawayConfig
    assert loaded.config == config
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert get_model_classes("ThrowawayForCausalLM").kv_cache_manager_class is (
        ThrowawayKVCacheManager
    )


def write_config(model_dir, **changes):
    data = {**tiny_config().to_dict(), **changes}
    data = {k: v for k, v in data.items() if v is not None}
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(data))
    return model_dir


def test_an_unknown_architecture_is_an_error_naming_it_and_the_known_ones(tmp_path):
    model_dir = write_config(tmp_path / "m", architectures=["NotAModelForCausalLM"])
    known = (
        r"'NotAModelForCausalLM' is not a known architecture; known: "
        r"\['MiniMaxM3SparseForConditionalGeneration', 'MiniMaxM3VLForCausalLM'\]"
    )
    with pytest.raises(ValueError, match=known):
        load_model(model_dir)
    with pytest.raises(ValueError, match=known):
        get_model_classes("NotAModelForCausalLM")


def test_a_config_without_architectures_is_an_error_naming_the_key(tmp_path):
    model_dir = write_config(tmp_path / "m", architectures=None)
    with pytest.raises(ValueError, match=r"config.json: architectures=None"):
        load_model(model_dir)


def test_an_unknown_attn_backend_is_refused_by_the_loader():
    with pytest.raises(ValueError, match="attn_backend='FLASHINFER' is unknown"):
        load_model(BUNDLED_TARGET, attn_backend="FLASHINFER")


def test_the_drafter_needs_only_the_targets_sizes_and_embedding():
    config = json.loads((BUNDLED_DRAFT / "config.json").read_text())
    embedding = torch.nn.Embedding(config["vocab_size"], config["target_hidden_size"])
    target = SimpleNamespace(
        config=SimpleNamespace(
            vocab_size=config["vocab_size"], hidden_size=config["target_hidden_size"]
        ),
        model=SimpleNamespace(embed_tokens=embedding),
    )
    draft = load_eagle3(BUNDLED_DRAFT, target, layer_idx=4)
    assert draft.embed_tokens is embedding and draft.fc.weight.dtype == torch.float32
    target.config.vocab_size = 7
    with pytest.raises(ValueError, match="the target has 7"):
        load_eagle3(BUNDLED_DRAFT, target, layer_idx=4)
