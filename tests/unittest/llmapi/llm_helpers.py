"""A random-init tiny MiniMax-M3 checkpoint (``m3_helpers.TINY``) with a character tokenizer,
written to a directory."""

import sys
from pathlib import Path

from tensorrt_llm._torch.models.checkpoint import random_model, save_pretrained
from tensorrt_llm._torch.models.configuration_minimaxm3 import MiniMaxM3Config
from tensorrt_llm.tokenizer import build_char_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "_torch"))
from m3_helpers import TINY  # noqa: E402

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +-*=?.,:\n"
SPECIALS = ["<unk>", "<eos>"]


def write_tiny_checkpoint(model_dir: Path, seed: int = 0, **overrides) -> Path:
    tokenizer = build_char_tokenizer(ALPHABET, SPECIALS)
    config = MiniMaxM3Config.from_dict(
        {
            **TINY,
            "vocab_size": tokenizer.get_vocab_size(),
            "max_position_embeddings": 256,
            "index_block_size": 16,
            "eos_token_id": tokenizer.token_to_id("<eos>"),
            **overrides,
        }
    )
    save_pretrained(random_model(config, seed=seed, std=0.15), config, model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


def write_tiny_eagle3(model_dir: Path, target_dir: Path, seed: int = 1, **overrides) -> Path:
    """A random-init Eagle3 drafter for the checkpoint in ``target_dir``: 4 KV heads (the target has
    2), so its per-block size differs from every target buffer."""
    from tensorrt_llm._torch.models.checkpoint import random_eagle3
    from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config

    target = MiniMaxM3Config.from_pretrained(target_dir)
    config = Eagle3Config.from_dict(
        {
            "hidden_size": target.hidden_size,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 8,
            "vocab_size": target.vocab_size,
            "draft_vocab_size": target.vocab_size - 4,
            "target_hidden_size": target.hidden_size,
            **overrides,
        }
    )
    save_pretrained(
        random_eagle3(config, target.num_hidden_layers, seed=seed, std=0.15), config, model_dir
    )
    return model_dir
