"""HF-style checkpoints: ``config.json`` + ``model.safetensors`` in one directory.

Loading is by architecture (``registry.py``): nothing here knows a particular model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tensorrt_llm._torch.attention_backend.utils import get_attention_backend
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.config_utils import read_config_json
from tensorrt_llm._torch.models.modeling_speculative import (
    Eagle3Config,
    Eagle3DraftModel,
    Eagle3Target,
)
from tensorrt_llm._torch.models.registry import ModelConfig, architecture_of, get_model_classes
from tensorrt_llm._torch.modules.linear import shard_weight

WEIGHTS = "model.safetensors"


def save_pretrained(model: torch.nn.Module, config, model_dir: str | Path) -> None:
    """Write ``config.json`` and the weights (a tied LM head is stored once, as the embedding)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(model_dir / WEIGHTS))


def load_state_dict_into(model: torch.nn.Module, model_dir: str | Path, tied: bool) -> None:
    """Load weights strictly: a missing, unexpected or mis-shaped tensor is an error naming it.
    A tensor-parallel layer takes its rank's shard of the checkpoint's tensor (``shard_weight``);
    a tied LM head split over ranks takes its shard of the embedding."""
    path = Path(model_dir) / WEIGHTS
    if not path.is_file():
        raise ValueError(f"model={str(model_dir)!r}: no {WEIGHTS} there")
    state = load_file(str(path))
    expected = model.state_dict()
    modules = dict(model.named_modules())
    if (
        tied
        and "lm_head.weight" not in state
        and model.lm_head.weight is not model.model.embed_tokens.weight
    ):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        tied = False
    if tied:
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}"
        )
    for name, tensor in state.items():
        owner, _, kind = name.rpartition(".")
        if kind == "weight" and owner in modules:
            tensor = state[name] = shard_weight(modules[owner], tensor)
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=not tied)


def load_config(model_dir: str | Path) -> ModelConfig:
    """The config of the checkpoint in ``model_dir``, of the class its ``architectures[0]`` selects."""
    data = read_config_json(model_dir, "model")
    architecture = architecture_of(data, f"model={str(model_dir)!r}: config.json")
    return get_model_classes(architecture).config_class.from_dict(data)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_backend: str = "VANILLA",
    mapping: Mapping | None = None,
) -> torch.nn.Module:
    """The model in ``model_dir``, of the class its ``architectures[0]`` selects, weights loaded
    strictly, in eval mode; its config is ``model.config``. ``dtype`` defaults to the config's
    ``torch_dtype``; ``attn_backend`` is a ``get_attention_backend`` name; ``mapping`` says which
    tensor-parallel shard this rank holds (all of it by default)."""
    config = load_config(model_dir)
    model_class = get_model_classes(config.architectures[0]).model_class
    model = model_class(config, get_attention_backend(attn_backend), mapping or Mapping())
    load_state_dict_into(model, model_dir, config.tie_word_embeddings)
    dtype = dtype or getattr(torch, config.torch_dtype)
    return model.to(device=device, dtype=dtype).eval()


def load_eagle3(
    model_dir: str | Path,
    target: Eagle3Target,
    layer_idx: int,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_backend: str = "VANILLA",
    mapping: Mapping | None = None,
) -> Eagle3DraftModel:
    """An Eagle3 drafter whose KV layer id is ``layer_idx``, sharing the target's embedding.
    ``dtype`` defaults to the embedding's."""
    config = Eagle3Config.from_pretrained(model_dir)
    if (
        config.vocab_size != target.config.vocab_size
        or config.target_hidden_size != target.config.hidden_size
    ):
        raise ValueError(
            f"speculative_model={str(model_dir)!r} drafts for vocab_size={config.vocab_size}, "
            f"target_hidden_size={config.target_hidden_size}; the target has {target.config.vocab_size}, "
            f"{target.config.hidden_size}"
        )
    model = Eagle3DraftModel(config, layer_idx, get_attention_backend(attn_backend), mapping)
    load_state_dict_into(model, model_dir, tied=False)
    embed_tokens = target.model.embed_tokens
    model = model.to(device=device, dtype=dtype or embed_tokens.weight.dtype).eval()
    model.embed_tokens = embed_tokens
    return model


def _random_init(model: torch.nn.Module, seed: int, std: float) -> torch.nn.Module:
    """Norm weights 1, every other parameter N(0, std), from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model.eval()


def random_eagle3(
    config: Eagle3Config, layer_idx: int, seed: int = 0, std: float = 0.02
) -> Eagle3DraftModel:
    """A randomly initialised drafter whose draft vocabulary is the first draft_vocab_size target
    tokens (d2t all zero)."""
    return _random_init(Eagle3DraftModel(config, layer_idx), seed, std)


def random_model(
    config: ModelConfig, seed: int = 0, std: float = 0.02, attn_backend: str = "VANILLA"
) -> torch.nn.Module:
    """A randomly initialised model of the class ``config.architectures[0]`` selects (tests, and
    the starting point of training)."""
    model_class = get_model_classes(config.architectures[0]).model_class
    return _random_init(model_class(config, get_attention_backend(attn_backend)), seed, std)
