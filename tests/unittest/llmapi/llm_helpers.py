"""A random-init tiny MiniMax-M3 checkpoint with a character tokenizer, written to a directory."""

from pathlib import Path

from tensorrt_llm._torch.models.checkpoint import random_model, save_pretrained
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
