"""Make M3-tiny-VL: the bundled M3-tiny with a vision tower, to try images end to end.

    python examples/models/make_m3_tiny_vl.py OUT_DIR

writes ``OUT_DIR/target`` (a MiniMax-M3 VL checkpoint in the hub layout, with its tokenizer and
``preprocessor_config.json``) and ``OUT_DIR/eagle3`` (the bundled drafter). The text model is the
bundled one's with three tokens added for the image marks (``]<]image[>[`` and its brackets); their
embedding and output rows copy ``<pad>``'s, a token the model never predicts, so its replies to
text are the bundled model's. The vision tower and projector are random: an image changes the
reply, but nothing in it is recognised. Images are resized to at most 8 x 8 patches of 14 pixels
(16 image tokens).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tensorrt_llm._torch.models.checkpoint import load_model, random_model, save_pretrained
from tensorrt_llm._torch.models.configuration_minimaxm3 import MiniMaxM3Config
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.inputs.multimodal_prompts import IMAGE_TOKEN, VISION_END, VISION_START

VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
PREPROCESSOR = {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16}}
PAD = "<pad>"


def make(out_dir: str | Path, seed: int = 0) -> Path:
    """Write M3-tiny-VL under ``out_dir``; returns its target directory."""
    out_dir = Path(out_dir)
    target_dir, draft_dir = out_dir / "target", out_dir / "eagle3"
    tokenizer = Tokenizer.from_file(str(BUNDLED_TARGET / "tokenizer.json"))
    pad = tokenizer.token_to_id(PAD)
    tokenizer.add_special_tokens([IMAGE_TOKEN, VISION_START, VISION_END])
    vocab = tokenizer.get_vocab_size()
    data = json.loads((BUNDLED_TARGET / "config.json").read_text())
    data["text_config"]["vocab_size"] = vocab
    data.update(
        vision_config=VISION,
        projector_hidden_size=data["text_config"]["hidden_size"],
        image_token_index=tokenizer.token_to_id(IMAGE_TOKEN),
    )
    config = MiniMaxM3Config.from_dict(data)
    model = random_model(config, seed=seed, std=0.05)
    text = load_model(BUNDLED_TARGET).state_dict()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                if "norm" in name and name.endswith(".weight"):
                    tensor.fill_(1.0)  # LayerNorms start as the identity
                continue
            source = text[name].to(tensor.dtype)
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                extra = source[pad].expand(vocab - source.shape[0], -1)
                source = torch.cat([source, extra])
            tensor.copy_(source)
    save_pretrained(model, config, target_dir)
    tokenizer.save(str(target_dir / "tokenizer.json"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (BUNDLED_TARGET / name).is_file():
            shutil.copy(BUNDLED_TARGET / name, target_dir)
    (target_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    draft_dir.mkdir(parents=True, exist_ok=True)
    draft = json.loads((BUNDLED_DRAFT / "config.json").read_text())
    draft["vocab_size"] = vocab  # drafts stay in the first 84 ids (its d2t)
    (draft_dir / "config.json").write_text(json.dumps(draft, indent=2))
    shutil.copy(BUNDLED_DRAFT / "model.safetensors", draft_dir)
    return target_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(make(sys.argv[1]))
