"""MiniMax-M3 checkpoints on disk: the hub layout written and read back, shards, the families not
served yet skipped with one log line each, and every loader error naming what is wrong."""

import json
import logging

import pytest
import torch
from m3_helpers import tiny_config
from safetensors.torch import load_file, save_file

from tensorrt_llm._torch.models import checkpoint_loader
from tensorrt_llm._torch.models.checkpoint import load_model, random_model, save_pretrained
from tensorrt_llm._torch.models.configuration_minimaxm3 import VL_ARCHITECTURE

HUB_MOE = "language_model.model.layers.1.block_sparse_moe"


@pytest.fixture
def hub_checkpoint(tmp_path):
    config = tiny_config(architectures=[VL_ARCHITECTURE])
    model = random_model(config, seed=4, std=0.1)
    with torch.no_grad():  # a nonzero correction bias, so a dropped bias would show
        model.model.layers[1].mlp.e_score_correction_bias.normal_()
    save_pretrained(model, config, tmp_path / "hub")
    return model, tmp_path / "hub"


def tensors(model_dir):
    return load_file(str(model_dir / "model.safetensors"))


def rewrite(model_dir, state):
    save_file(state, str(model_dir / "model.safetensors"))


def assert_same_weights(a, b):
    for name, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor), name


def test_the_hub_layout_is_written_and_read_back(hub_checkpoint):
    model, model_dir = hub_checkpoint
    names = set(tensors(model_dir))
    assert {
        f"{HUB_MOE}.gate.weight",
        f"{HUB_MOE}.e_score_correction_bias",
        f"{HUB_MOE}.experts.3.w1.weight",
        f"{HUB_MOE}.experts.3.w2.weight",
        f"{HUB_MOE}.experts.3.w3.weight",
        f"{HUB_MOE}.shared_experts.up_proj.weight",
        "language_model.model.layers.0.mlp.gate_proj.weight",
        "language_model.model.layers.2.self_attn.index_q_proj.weight",
        "language_model.model.layers.2.self_attn.index_k_norm.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
    } <= names
    assert not any(".mlp.experts.w13" in n or n.startswith("model.") for n in names)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [VL_ARCHITECTURE] and "text_config" in config
    assert_same_weights(model, load_model(model_dir, torch.float32))


def test_sharded_checkpoints_load_tensor_by_tensor(hub_checkpoint, monkeypatch):
    model, model_dir = hub_checkpoint
    state = tensors(model_dir)
    (model_dir / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {}
    for i in range(3):
        shard = f"model-0000{i + 1}-of-00003.safetensors"
        part = {n: state[n] for n in names[i::3]}
        save_file(part, str(model_dir / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reads = []
    real = checkpoint_loader.checkpoint_tensors

    def counting(model_dir):
        for name, get in real(model_dir):
            yield name, lambda name=name, get=get: reads.append(name) or get()

    monkeypatch.setattr(checkpoint_loader, "checkpoint_tensors", counting)
    loaded = load_model(model_dir, torch.float32)
    assert_same_weights(model, loaded)
    assert sorted(reads) == names  # each tensor read once, one at a time
    assert torch.get_default_dtype() == torch.float32


def test_the_model_is_built_at_its_dtype_not_converted_after(hub_checkpoint):
    _, model_dir = hub_checkpoint
    loaded = load_model(model_dir, torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_parts_not_served_yet_are_skipped_with_one_line_per_family(hub_checkpoint, caplog):
    model, model_dir = hub_checkpoint
    state = tensors(model_dir)
    extra = {
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": torch.zeros(2),
        "vision_tower.vision_model.pre_layrnorm.weight": torch.zeros(2),
        "multi_modal_projector.linear_1.weight": torch.zeros(2),
        "patch_merge_mlp.linear_2.bias": torch.zeros(2),
        "mtp.layers.0.eh_proj.weight": torch.zeros(2),
        "language_model.model.mtp.0.norm.weight": torch.zeros(2),
    }
    rewrite(model_dir, {**state, **extra})
    caplog.set_level(logging.INFO, logger="tensorrt_llm")
    assert_same_weights(model, load_model(model_dir, torch.float32))
    lines = sorted(
        r.getMessage().split(": ", 1)[1] for r in caplog.records if "skipped" in r.getMessage()
    )
    assert lines == [
        "skipped 1 multi_modal_projector.* tensor(s) (no module takes them)",
        "skipped 1 patch_merge_mlp.* tensor(s) (no module takes them)",
        "skipped 2 mtp.* tensor(s) (no module takes them)",
        "skipped 2 vision_tower.* tensor(s) (no module takes them)",
    ]


def test_a_missing_tensor_is_an_error_listing_it(hub_checkpoint):
    _, model_dir = hub_checkpoint
    state = tensors(model_dir)
    del state[f"{HUB_MOE}.experts.2.w3.weight"], state["language_model.model.norm.weight"]
    rewrite(model_dir, state)
    message = (
        r"2 missing tensor\(s\) \['model.layers.1.mlp.experts.2.w3.weight', 'model.norm.weight'\]"
    )
    with pytest.raises(ValueError, match=message):
        load_model(model_dir, torch.float32)


def test_an_unexpected_tensor_is_an_error_listing_it(hub_checkpoint):
    _, model_dir = hub_checkpoint
    state = tensors(model_dir)
    state["language_model.model.layers.0.self_attn.index_q_proj.weight"] = torch.zeros(16, 32)
    state[f"{HUB_MOE}.experts.9.w1.weight"] = torch.zeros(16, 32)
    rewrite(model_dir, state)
    with pytest.raises(
        ValueError, match=r"2 unexpected tensor\(s\) \['language_model.model.layers.0"
    ):
        load_model(model_dir, torch.float32)


def test_a_mis_shaped_tensor_is_an_error_naming_it(hub_checkpoint):
    _, model_dir = hub_checkpoint
    state = tensors(model_dir)
    state[f"{HUB_MOE}.experts.1.w2.weight"] = torch.zeros(32, 8)
    rewrite(model_dir, state)
    with pytest.raises(ValueError, match=rf"{HUB_MOE}.experts.1.w2.weight has shape \(32, 8\)"):
        load_model(model_dir, torch.float32)


def test_a_shard_the_index_lists_must_be_there(hub_checkpoint):
    _, model_dir = hub_checkpoint
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"lists shards that are not there: \['model-00001"):
        load_model(model_dir, torch.float32)
    (model_dir / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match="not a safetensors index with a weight_map"):
        load_model(model_dir, torch.float32)


def test_a_checkpoint_without_weights_is_an_error(hub_checkpoint):
    _, model_dir = hub_checkpoint
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(model_dir, torch.float32)


@pytest.fixture
def tied_checkpoint(tmp_path):
    config = tiny_config(architectures=[VL_ARCHITECTURE], tie_word_embeddings=True)
    model = random_model(config, seed=5, std=0.1)
    save_pretrained(model, config, tmp_path / "tied")
    return model, tmp_path / "tied"


HEAD, EMBED = "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"


def test_a_tied_head_is_the_embedding_when_the_checkpoint_leaves_it_out(tied_checkpoint):
    model, model_dir = tied_checkpoint
    assert HEAD not in tensors(model_dir) and EMBED in tensors(model_dir)
    loaded = load_model(model_dir, torch.float32)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_same_weights(model, loaded)


def test_a_tied_checkpoint_that_stores_only_the_head_gives_the_embedding(tied_checkpoint):
    model, model_dir = tied_checkpoint
    state = tensors(model_dir)
    state[HEAD] = state.pop(EMBED)
    rewrite(model_dir, state)
    loaded = load_model(model_dir, torch.float32)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_tied_checkpoint_with_a_different_head_is_served_apart(tied_checkpoint):
    """As transformers: both stored and different, the head is the checkpoint's head."""
    model, model_dir = tied_checkpoint
    state = tensors(model_dir)
    state[HEAD] = state[EMBED] * 2
    rewrite(model_dir, state)
    loaded = load_model(model_dir, torch.float32)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, state[HEAD])
    assert torch.equal(loaded.model.embed_tokens.weight, state[EMBED])
    state[HEAD] = state[EMBED].clone()  # the same values: shared again
    rewrite(model_dir, state)
    loaded = load_model(model_dir, torch.float32)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
