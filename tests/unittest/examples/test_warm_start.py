"""Starting an M3-format target from a plain-format one (``examples/training/warm_start.py``):
every weight but the vocabulary's is copied; shared characters keep their rows, M3's end of turn
takes ``<|end|>``'s, a phrase token's embedding is the mean of its characters'; a model of another
width is refused by name."""

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "training"))
from common import build_tokenizer  # noqa: E402
from train_target import target_config  # noqa: E402
from warm_start import target_source, warm_start  # noqa: E402

from tensorrt_llm._torch.models.checkpoint import random_model, save_pretrained  # noqa: E402


def tiny(chat_format: str, hidden: int, seed: int):
    tokenizer = build_tokenizer(chat_format)
    eos = "[e~[" if chat_format == "m3" else "<|end|>"
    config = target_config(
        tokenizer.get_vocab_size(), tokenizer.token_to_id(eos), Namespace(hidden=hidden)
    )
    return random_model(config, seed=seed, std=0.02), config, tokenizer


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    model, config, tokenizer = tiny("plain", 64, seed=1)
    out = tmp_path_factory.mktemp("plain")
    save_pretrained(model, config, out)
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def test_an_m3_target_starts_from_a_plain_one(plain):
    model, _, tokenizer = tiny("m3", 64, seed=2)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    old_state, old_tokenizer = target_source(plain)
    counts = warm_start(model, tokenizer, (old_state, old_tokenizer), plain)
    state = model.state_dict()
    layer = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(state[layer], old_state[layer])
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    old_embed = old_state["model.embed_tokens.weight"]
    new, old = tokenizer.token_to_id, old_tokenizer.token_to_id
    assert torch.equal(embed[new("7")], old_embed[old("7")])
    assert torch.equal(head[new("7")], old_state["lm_head.weight"][old("7")])
    assert torch.equal(embed[new("[e~[")], old_embed[old("<|end|>")])
    phrase = new("Always reason before you answer.\n")
    letters = old_tokenizer.encode("Always reason before you answer.\n").ids
    assert torch.allclose(embed[phrase], old_embed[letters].mean(0))
    assert torch.equal(head[phrase], fresh["lm_head.weight"][phrase])  # not composed
    assert torch.equal(embed[new("{")], fresh["model.embed_tokens.weight"][new("{")])
    assert counts["copied"] >= 80 and counts["aliased"] == 3 and counts["composed"] > 20


def test_a_target_of_another_width_is_refused_by_name(plain):
    model, _, tokenizer = tiny("m3", 128, seed=2)
    with pytest.raises(
        SystemExit, match=r"model.layers.0.input_layernorm.weight is \(64,\) there, \(128,\) here"
    ):
        warm_start(model, tokenizer, target_source(plain), plain)
