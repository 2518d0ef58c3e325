"""Pad an M3-format target and its Eagle3 drafter to the tokenizer's padded vocabulary.

    python examples/training/pad_vocab.py examples/models/m3-tiny/target examples/models/m3-tiny/eagle3

``m3_format.build_m3_tokenizer`` pads the vocabulary with filler tokens to ``VOCAB_SIZE`` (a
multiple of 8, so that the vocabulary-parallel embedding and LM heads split evenly over up to 8
tensor-parallel ranks, as published vocabularies are padded). A checkpoint trained on the unpadded
vocabulary gets the new rows here: each copies ``<pad>``'s embedding and LM-head rows (a token
the model is never trained to predict, so the fillers are never chosen either), the drafter's
draft-to-target offsets are 0 for them, and both configs and the tokenizer take the new size.
``training.json`` records the padding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from m3_format import VOCAB_SIZE, build_m3_tokenizer, save_m3_tokenizer  # noqa: E402

WEIGHTS = "model.safetensors"


def pad_rows(tensor: torch.Tensor, source_row: int | None) -> torch.Tensor:
    """``tensor`` grown to ``VOCAB_SIZE`` rows: copies of row ``source_row``, or zeros."""
    extra = VOCAB_SIZE - tensor.shape[0]
    if source_row is None:
        fill = torch.zeros((extra, *tensor.shape[1:]), dtype=tensor.dtype)
    else:
        fill = tensor[source_row].expand(extra, *tensor.shape[1:])
    return torch.cat([tensor, fill])


def pad_checkpoint(model_dir: Path, rows: dict[str, int | None], config_keys) -> int:
    """Pad the tensors named in ``rows`` (checkpoint name -> the row to copy, None for zeros) and
    the config's ``config_keys``; returns the old vocabulary size."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    holder = config.get("text_config", config)
    old = holder[config_keys[0]]
    if old == VOCAB_SIZE:
        return old
    state = load_file(str(model_dir / WEIGHTS))
    for name, source_row in rows.items():
        state[name] = pad_rows(state[name], source_row).contiguous()
    save_file(state, str(model_dir / WEIGHTS), metadata={"format": "pt"})
    for key in config_keys:
        holder[key] = VOCAB_SIZE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    record_path = model_dir / "training.json"
    record = json.loads(record_path.read_text())
    record["vocab_padded"] = {"from": old, "to": VOCAB_SIZE, "script": "pad_vocab.py"}
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return old


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    target, drafter = Path(sys.argv[1]), Path(sys.argv[2])
    tokenizer = build_m3_tokenizer()
    pad = tokenizer.token_to_id("<pad>")
    prefix = "language_model."
    head, embed = f"{prefix}lm_head.weight", f"{prefix}model.embed_tokens.weight"
    old = pad_checkpoint(target, {head: pad, embed: pad}, ["vocab_size"])
    pad_checkpoint(
        drafter, {"lm_head.weight": pad, "d2t": None}, ["vocab_size", "draft_vocab_size"]
    )
    save_m3_tokenizer(tokenizer, target)
    print(f"{target} and {drafter}: vocabulary {old} -> {VOCAB_SIZE}")


if __name__ == "__main__":
    main()
