"""A random-init tiny MiniMax-M3 checkpoint with a character tokenizer, written to a directory."""

from pathlib import Path

from tensorrt_llm._torch.models.checkpoint import random_minimaxm3, save_pretrained
from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3Config
from tensorrt_llm.tokenizer import build_char_tokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +-*=?.,:\n"
SPECIALS = ["<unk>", "<eos>"]


def write_tiny_checkpoint(model_dir: Path, seed: int = 0, **overrides) -> Path:
    tokenizer = build_char_tokenizer(ALPHABET, SPECIALS)
    config = MiniMaxM3Config.from_dict(
        {
            "vocab_size": tokenizer.get_vocab_size(),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rotary_dim": 4,
            "max_position_embeddings": 256,
            "eos_token_id": tokenizer.token_to_id("<eos>"),
            "sparse_attention_config": {
                "index_n_heads": 2,
                "index_head_dim": 8,
                "topk_blocks": 2,
                "block_size": 16,
                "num_dense_layers": 1,
            },
            **overrides,
        }
    )
    save_pretrained(random_minimaxm3(config, seed=seed, std=0.15), config, model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir
