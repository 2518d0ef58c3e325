"""trtllm-kv-layout: prints the slot map of a YAML layout, and rejects bad files clearly."""

from pathlib import Path

import pytest
import yaml

from tensorrt_llm.commands.kv_layout import config_from_yaml, main

EXAMPLE = Path(__file__).parents[3] / "examples" / "configs" / "kv_layout_m3_tiny.yaml"


def test_example_layout_prints_every_buffer(capsys):
    assert main([str(EXAMPLE), "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "slot_bytes=425984" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.strip()[:1].isdigit() and len(line.split()) == 7
    ]
    assert [(r[0], r[1]) for r in rows] == [
        ("0", "key"),
        ("0", "value"),
        ("1", "key"),
        ("1", "value"),
        ("1", "index_key"),
        ("2", "key"),
        ("2", "value"),
        ("2", "index_key"),
        ("3", "key"),
        ("3", "value"),
        ("3", "index_key"),
        ("4", "key"),
        ("4", "value"),
    ]
    assert [r[-1] for r in rows if r[1] == "index_key" or r[0] == "4"] == ["sub-page"] * 5
    assert "request B: 128 tokens reused" in out


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
