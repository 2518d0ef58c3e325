"""config.json of the published MiniMax-M3, both forms (nested text_config, flat), the hub's legacy
names mapped as transformers maps them; unknown keys warn once; values we cannot serve are errors
that name the key."""

import json
import logging

import pytest
from m3_helpers import TINY, tiny_config

from tensorrt_llm._torch.models.configuration_minimaxm3 import (
    SPARSE,
    TEXT_ARCHITECTURE,
    VL_ARCHITECTURE,
    MiniMaxM3Config,
)
from tensorrt_llm.quantization import FP8_BLOCK_FORMAT

TEXT = {k: v for k, v in TINY.items() if k not in ("architectures", "model_type", "dtype")}


def nested(text: dict, **outer) -> dict:
    return {
        "architectures": [VL_ARCHITECTURE],
        "model_type": "minimax_m3_vl",
        "text_config": {"model_type": "minimax_m3_vl_text", **text},
        "vision_config": {"hidden_size": 16, "num_attention_heads": 2},
        "image_token_index": 200025,
        **outer,
    }


def test_the_nested_and_the_flat_forms_give_the_same_text_model():
    flat = MiniMaxM3Config.from_dict({**TEXT, "architectures": [TEXT_ARCHITECTURE]})
    vl = MiniMaxM3Config.from_dict(nested(TEXT))
    assert vl.architectures == (VL_ARCHITECTURE,) and flat.architectures == (TEXT_ARCHITECTURE,)
    text_part = {**vl.__dict__, "vision": None}
    assert MiniMaxM3Config(**text_part) == MiniMaxM3Config(
        **{**flat.__dict__, "architectures": (VL_ARCHITECTURE,)}
    )
    assert flat.vision is None
    vision = vl.vision  # the vision side: its own keys, the outer ones, the text width
    assert (vision.hidden_size, vision.num_attention_heads, vision.patch_size) == (16, 2, 14)
    assert (vision.image_token_id, vision.text_hidden_size) == (200025, TEXT["hidden_size"])
    assert vl.sparse_layer_ids == (1, 2) and vl.moe_layer_ids == (1,) and vl.rotary_dim == 4


def test_to_dict_round_trips_in_both_forms():
    for architecture in (VL_ARCHITECTURE, TEXT_ARCHITECTURE):
        config = tiny_config(architectures=[architecture])
        data = json.loads(json.dumps(config.to_dict()))
        assert ("text_config" in data) == (architecture == VL_ARCHITECTURE)
        assert MiniMaxM3Config.from_dict(data) == config
    with_vision = MiniMaxM3Config.from_dict(nested(TEXT))
    data = json.loads(json.dumps(with_vision.to_dict()))
    assert data["vision_config"]["rope_parameters"]["rope_type"] == "axial"
    assert MiniMaxM3Config.from_dict(data) == with_vision


def test_the_hubs_legacy_names_map_as_transformers_maps_them():
    legacy = {k: v for k, v in TEXT.items() if not k.startswith("index_")}
    del legacy["layer_types"], legacy["mlp_layer_types"], legacy["rope_parameters"]
    legacy.update(
        hidden_act="swigluoai",
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        moe_layer_freq=[0, 1, 0],
        sparse_attention_config={
            "sparse_num_index_heads": 2,
            "sparse_index_dim": 8,
            "sparse_block_size": 8,
            "sparse_topk_blocks": 3,
            "sparse_local_block": 1,
            "sparse_attention_freq": [0, 1, 1],
        },
        torch_dtype="float32",
    )
    assert MiniMaxM3Config.from_dict(nested(legacy)) == MiniMaxM3Config.from_dict(nested(TEXT))


def test_missing_keys_take_transformers_defaults():
    config = MiniMaxM3Config.from_dict({"architectures": [VL_ARCHITECTURE], "text_config": {}})
    assert (config.hidden_size, config.num_hidden_layers, config.num_local_experts) == (
        6144,
        60,
        128,
    )
    assert config.rope_theta == 5e6 and config.rotary_dim == 128  # no partial_rotary_factor
    assert (
        config.layer_types == ("full_attention",) * 60
        and config.mlp_layer_types == ("sparse",) * 60
    )
    assert config.eos_token_ids == (200020,) and config.torch_dtype == "float32"


def test_sparse_layers_can_be_anywhere():
    config = tiny_config(layer_types=[SPARSE, "full_attention", SPARSE])
    assert config.sparse_layer_ids == (0, 2)
    assert [layer.index_head_dim for layer in config.kv_cache_layers()] == [8, 0, 8]


@pytest.mark.parametrize(("value", "ids"), [(5, (5,)), ([5, 7], (5, 7)), (None, ())])
def test_eos_token_id_is_an_int_or_a_list(value, ids):
    assert tiny_config(eos_token_id=value).eos_token_ids == ids


def test_generation_config_names_the_end_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(eos_token_id=3).to_dict()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert MiniMaxM3Config.from_pretrained(tmp_path).eos_token_ids == (3, 9)


def test_the_outer_config_comes_first_and_rope_scaling_replaces_rope_parameters():
    outer = nested({**TEXT, "eos_token_id": 5, "dtype": "float16"}, eos_token_id=7, dtype="float32")
    config = MiniMaxM3Config.from_dict(outer)
    assert config.eos_token_ids == (7,) and config.torch_dtype == "float32"
    scaling = {"rope_type": "default", "rope_theta": 123.0, "partial_rotary_factor": 1.0}
    config = tiny_config(rope_scaling=scaling)
    assert (config.rope_theta, config.rotary_dim) == (123.0, 8)
    no_head_dim = {**TEXT, "head_dim": None, "index_head_dim": 64}
    assert MiniMaxM3Config.from_dict(no_head_dim).head_dim == 128  # as transformers


def test_dtype_or_torch_dtype(tmp_path):
    assert tiny_config(dtype="bfloat16").torch_dtype == "bfloat16"
    data = {**TEXT, "torch_dtype": "float16"}
    assert MiniMaxM3Config.from_dict(data).torch_dtype == "float16"
    assert MiniMaxM3Config.from_dict(nested(TEXT, dtype="bfloat16")).torch_dtype == "bfloat16"


def test_unknown_keys_get_one_warning_line_naming_them(caplog):
    caplog.set_level(logging.WARNING, logger="tensorrt_llm")
    tiny_config(fancy_new_knob=1, another=2)
    lines = [r.getMessage() for r in caplog.records if "unknown key" in r.getMessage()]
    assert lines == ["config.json: ignoring unknown key(s) ['another', 'fancy_new_knob']"]
    caplog.clear()
    text = {**TEXT, "sparse_attention_config": {"sparse_new": 1}, "knob": 3}
    MiniMaxM3Config.from_dict(nested(text, vision_config={}, new_top_level=1))
    lines = [r.getMessage() for r in caplog.records if "unknown key" in r.getMessage()]
    assert lines == [
        "config.json: ignoring unknown key(s) ['new_top_level', "
        "'text_config.knob', 'text_config.sparse_attention_config.sparse_new']"
    ]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"index_n_heads": 1}, r"index_n_heads=1 must equal num_key_value_heads=2"),
        ({"layer_types": ["full_attention", "sliding"]}, r"layer_types has 2 entries"),
        ({"layer_types": ["full_attention", "x", "x"]}, r"layer_types has \['x'\]"),
        ({"mlp_layer_types": ["dense", "moe", "dense"]}, r"mlp_layer_types has \['moe'\]"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0}},
            r"rope_parameters.rope_type='yarn'",
        ),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"rope_type='linear'"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"dtype": "float8"}, r"dtype='float8'"),
        (
            {"quantization_config": {"quant_method": "awq"}},
            r"quantization_config.quant_method='awq' is not served; FP8 checkpoints need",
        ),
        (
            {"quantization_config": {**FP8_BLOCK_FORMAT, "weight_block_size": [1, 128]}},
            r"quantization_config.weight_block_size=\[1, 128\] is not served",
        ),
        (
            {"quantization_config": {**FP8_BLOCK_FORMAT, "activation_scheme": "static"}},
            r"quantization_config.activation_scheme='static'",
        ),
        (
            {"quantization_config": {**FP8_BLOCK_FORMAT, "kv_cache_scheme": {}}},
            r"quantization_config has keys \['kv_cache_scheme'\] we do not serve",
        ),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 exceeds num_local_experts=4"),
        (
            {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.375}},
            r"partial_rotary_factor=0.375 rotates 3",
        ),
        ({"index_local_blocks": 4}, r"index_local_blocks=4 must be in \[0, index_topk_blocks=3\]"),
        ({"index_head_dim": 2}, r"index_head_dim=2 is narrower than the 4 rotary channels"),
        ({"eos_token_id": "eos"}, r"eos_token_id='eos'"),
        ({"hidden_size": 0}, r"hidden_size=0 must be a positive int"),
        ({"model_type": "llama"}, r"model_type='llama'"),
        ({"moe_layer_freq": 1, "mlp_layer_types": None}, r"moe_layer_freq=1 must be a list"),
        ({"sparse_attention_config": [1]}, r"sparse_attention_config=\[1\] must be an object"),
    ],
)
def test_a_value_we_cannot_serve_is_an_error_naming_the_key(changes, message):
    with pytest.raises(ValueError, match=message):
        MiniMaxM3Config.from_dict({**TEXT, **changes})


def test_an_fp8_block_scaled_checkpoint_config_is_read_and_written_back():
    quant = {**FP8_BLOCK_FORMAT, "modules_to_not_convert": ["lm_head", "gate"]}
    config = MiniMaxM3Config.from_dict(nested(TEXT, quantization_config=quant))
    assert config.quant_algo == "FP8_BLOCK_SCALES"
    assert config.modules_to_not_convert == ("lm_head", "gate")
    assert MiniMaxM3Config.from_dict(config.to_dict()) == config
    plain = MiniMaxM3Config.from_dict(TEXT)
    assert plain.quant_algo is None and "quantization_config" not in plain.to_dict()["text_config"]


def test_a_text_config_that_is_not_an_object_is_an_error():
    with pytest.raises(ValueError, match="text_config=3 must be an object"):
        MiniMaxM3Config.from_dict(nested(TEXT, text_config=3))
