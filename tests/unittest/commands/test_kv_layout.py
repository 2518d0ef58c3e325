"""trtllm-kv-layout: prints the slot map of a YAML layout, and rejects bad files clearly."""

import json
from pathlib import Path

import pytest
import yaml

from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.commands.kv_layout import config_from_yaml, main

EXAMPLE = Path(__file__).parents[3] / "examples" / "configs" / "kv_layout_m3_tiny.yaml"


def layout_rows(out: str) -> list[list[str]]:
    return [
        line.split()
        for line in out.splitlines()
        if line.strip()[:1].isdigit() and len(line.split()) == 7
    ]


BUNDLED_ROWS = [
    ("0", "key"),
    ("0", "value"),
    ("1", "key"),
    ("1", "value"),
    ("1", "index_key"),
    ("2", "key"),
    ("2", "value"),
    ("3", "key"),
    ("3", "value"),
    ("3", "index_key"),
    ("4", "key"),
    ("4", "value"),
]


def test_example_layout_prints_every_buffer(capsys):
    assert main([str(EXAMPLE), "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "slot_bytes=819200" in out
    rows = layout_rows(out)
    assert [(r[0], r[1]) for r in rows] == BUNDLED_ROWS
    assert [r[-1] for r in rows if r[1] == "index_key" or r[0] == "4"] == ["sub-page"] * 4
    assert "request B: 128 tokens reused" in out


def test_a_checkpoint_prints_the_layout_the_example_describes(capsys):
    assert main([str(EXAMPLE)]) == 0
    from_yaml = capsys.readouterr().out
    args = ["--model", str(BUNDLED_TARGET), "--speculative-model", str(BUNDLED_DRAFT)]
    assert main([*args, "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == from_yaml


def test_the_published_models_layout_has_index_k_on_its_sparse_layers_only(tmp_path, capsys):
    """The full MiniMax-M3 (transformers' defaults: 60 layers, 4 KV heads of 128) with sparse
    layers wherever layer_types puts them; only the configs are read."""
    sparse = {3, 4, 10, 59}
    layer_types = ["minimax_m3_sparse" if i in sparse else "full_attention" for i in range(60)]
    text = {"layer_types": layer_types}
    config = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(tmp_path), "--dtype", "bfloat16"]) == 0
    rows = layout_rows(capsys.readouterr().out)
    assert {int(r[0]) for r in rows if r[1] == "index_key"} == sparse
    assert {r[4] for r in rows if r[1] == "key"} == {"4x128"}
    assert {r[4] for r in rows if r[1] == "index_key"} == {"1x128"}


def test_the_published_models_mtp_layer_is_one_more_sparse_layer(tmp_path, capsys):
    """With ``--mtp``: the module's layer (id 60) has the target sparse layers' K, V and index-K,
    in whole pages; a config without the module is an error that says so."""
    sparse = {3, 59}
    layer_types = ["minimax_m3_sparse" if i in sparse else "full_attention" for i in range(60)]
    text = {"layer_types": layer_types, "num_mtp_modules": 1}
    config = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(tmp_path), "--mtp", "--dtype", "bfloat16"]) == 0
    rows = layout_rows(capsys.readouterr().out)
    assert {int(r[0]) for r in rows if r[1] == "index_key"} == sparse | {60}
    assert {(r[4], r[6]) for r in rows if r[0] == "60"} == {
        ("4x128", "page"),
        ("1x128", "sub-page"),
    }
    without = tmp_path / "without"
    without.mkdir()
    text["num_mtp_modules"] = 0
    (without / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(without), "--mtp"]) == 2
    assert "no MTP module" in capsys.readouterr().err
    # the bundled target carries one: its layer follows the target's 4
    assert main(["--model", str(BUNDLED_TARGET), "--mtp"]) == 0
    rows = layout_rows(capsys.readouterr().out)
    assert {int(r[0]) for r in rows if r[1] == "index_key"} == {1, 3, 4}


def test_a_model_or_a_layout_not_both(capsys):
    with pytest.raises(SystemExit):
        main([str(EXAMPLE), "--model", str(BUNDLED_TARGET)])
    with pytest.raises(SystemExit):
        main(["--speculative-model", str(BUNDLED_DRAFT), str(EXAMPLE)])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_slot": 3}, "unknown key(s) ['num_slot']"),
        ({"layers": [{"layer_id": 0, "heads": 2}]}, "layers[0]: unknown key(s) ['heads']"),
        ({"tokens_per_block": 100}, "tokens_per_block=100 must be a power of two"),
        ({"num_slots": 4}, "exactly one of 'num_slots' or 'max_tokens'"),
        ({"layers": [{"layer_id": 0, "dtype": "float64"}]}, "dtype='float64'"),
    ],
)
def test_bad_layout_names_the_key(edit, message):
    data = {**yaml.safe_load(EXAMPLE.read_text()), **edit}
    with pytest.raises(ValueError) as info:
        config_from_yaml(data)
    assert message in str(info.value)


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "tokens_per_block: 3\nnum_slots: 2\nlayers: [{layer_id: 0, num_kv_heads: 1, head_dim: 4}]\n"
    )
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "tokens_per_block=3" in err
