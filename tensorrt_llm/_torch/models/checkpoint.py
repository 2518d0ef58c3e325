"""HF-style checkpoints: ``config.json`` and safetensors weights (one file, or shards listed by
``model.safetensors.index.json``) in one directory.

Loading is by architecture (``registry.py``) and by the model class's ``checkpoint_layout``
(``PlainLayout`` unless the class names another): the layout maps each checkpoint tensor to
**canonical names** and says where each canonical name goes on this rank (a ``Destination``). The
loader here reads the files one tensor at a time into a model already allocated at its dtype and
device, so no second copy of the model is ever held, and is strict: a missing, unexpected or
mis-shaped tensor is an error that lists them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from tensorrt_llm._torch.attention_backend.utils import get_attention_backend
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.checkpoint_loader import (  # noqa: F401  (the loader's names)
    HEAD,
    WEIGHTS,
    WEIGHTS_INDEX,
    checkpoint_files,
    checkpoint_index,
    checkpoint_tensors,
    load_checkpoint_into,
    read_tensor,
)
from tensorrt_llm._torch.models.config_utils import read_config_json
from tensorrt_llm._torch.models.modeling_speculative import (
    Eagle3Config,
    Eagle3DraftModel,
    Eagle3Target,
)
from tensorrt_llm._torch.models.registry import ModelConfig, architecture_of, get_model_classes
from tensorrt_llm._torch.modules.fp8.block import FP8
from tensorrt_llm._torch.modules.fp8.modules import use_fp8_block
from tensorrt_llm.quantization import QuantAlgo


def save_pretrained(model: torch.nn.Module, config, model_dir: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` under the checkpoint names of the model's
    layout (``checkpoint_name``: MiniMax-M3's is the published hub layout).
    A tied LM head is stored once, as the embedding. One rank's whole model only."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    layout = type(model).checkpoint_layout
    state = {
        layout.checkpoint_name(name, config): dest.view.detach().contiguous().cpu()
        for name, dest in layout.destinations(model).items()
    }
    if config.tie_word_embeddings:
        state.pop(layout.checkpoint_name(HEAD, config), None)
    save_file(state, str(model_dir / WEIGHTS), metadata={"format": "pt"})


def load_config(model_dir: str | Path) -> ModelConfig:
    """The config of the checkpoint in ``model_dir``, of the class its ``architectures[0]`` selects."""
    data = read_config_json(model_dir, "model")
    architecture = architecture_of(data, f"model={str(model_dir)!r}: config.json")
    return get_model_classes(architecture).config_class.from_pretrained(model_dir)


@contextlib.contextmanager
def _allocate_on(device: str | torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New parameters are made on ``device`` in ``dtype`` inside the block."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(saved)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_backend: str = "VANILLA",
    mapping: Mapping | None = None,
    quant_algo: str | None = None,
    load_format: str = "auto",
    mtp_checkpoint: str | Path | None = None,
    **model_options,
) -> torch.nn.Module:
    """The model in ``model_dir``, of the class its ``architectures[0]`` selects, weights loaded
    strictly, in eval mode; its config is ``model.config``. ``dtype`` defaults to the config's
    ``torch_dtype``; ``attn_backend`` is a ``get_attention_backend`` name; ``mapping`` says which
    tensor-parallel shard this rank holds (all of it by default).

    FP8 (``quant_algo`` or the checkpoint's ``quantization_config``: ``"FP8_BLOCK_SCALES"``): on
    CUDA the layers ``use_fp8_block`` names keep FP8 weights (a bf16 checkpoint is quantized at
    load); on the CPU they keep the model's dtype, an FP8 checkpoint dequantized and a bf16 one
    rounded to the FP8 grid. ``load_format="dummy"``: no weight file read (``dummy_weights``).
    ``model_options``: the model constructor's (MiniMax-M3's ``num_mtp_modules``);
    ``mtp_checkpoint``: a standalone MTP checkpoint whose ``mtp.layers.*`` the modules load (in
    place of ``model_dir``'s, which may have none)."""
    config = load_config(model_dir)
    if mtp_checkpoint is not None:  # (the target's config may count no module of its own)
        modules = model_options.get("num_mtp_modules", 1)
        config = dataclasses.replace(config, num_mtp_modules=max(config.num_mtp_modules, modules))
    model_class = get_model_classes(config.architectures[0]).model_class
    backend = get_attention_backend(attn_backend)
    algo = quant_algo or config.quant_algo
    if algo not in (None, QuantAlgo.FP8_BLOCK_SCALES):
        raise ValueError(f"quant_algo={algo!r}; served: {QuantAlgo.FP8_BLOCK_SCALES.value!r}")
    with _allocate_on(device, dtype or getattr(torch, config.torch_dtype)):
        model = model_class(config, backend, mapping or Mapping(), **model_options)
    if algo is not None:
        store = torch.device(device).type == "cuda"
        use_fp8_block(model, config.modules_to_not_convert, store)
    _load(model, model_dir, load_format, {"mtp": Path(mtp_checkpoint)} if mtp_checkpoint else None)
    return model.eval()


LOAD_FORMATS = ("auto", "dummy")


def _load(
    model: torch.nn.Module, model_dir: str | Path, load_format: str, module_dirs=None
) -> None:
    if load_format == "auto":
        load_checkpoint_into(model, model_dir, module_dirs)
    elif load_format == "dummy":
        dummy_weights(model)
    else:
        raise ValueError(f"load_format={load_format!r}; expected one of {LOAD_FORMATS}")


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights made on the model's device (``load_format="dummy"``, upstream's name: a
    model of any size without its files, for benchmarks): norms at scale 1, every other weight
    N(0, std) from a device generator, FP8 layers quantized from such weights."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        offset = getattr(modules[name.rpartition(".")[0]], "weight_offset", None)
        if offset is not None:
            param.fill_(1.0 - offset)
        elif param.dtype != FP8:
            param.normal_(0.0, std, generator=generator)
    for dest in type(model).checkpoint_layout.destinations(model).values():
        if dest.fp8 is not None:  # FP8 storage takes quantized values; "grid" rounds its own
            fresh = torch.empty(dest.view.shape, device=device).normal_(
                0.0, std, generator=generator
            )
            dest.store(fresh)


def load_eagle3(
    model_dir: str | Path,
    target: Eagle3Target,
    layer_idx: int,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_backend: str = "VANILLA",
    mapping: Mapping | None = None,
    load_format: str = "auto",
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
    embed_tokens = target.model.embed_tokens
    backend = get_attention_backend(attn_backend)
    with _allocate_on(device, dtype or embed_tokens.weight.dtype):
        model = Eagle3DraftModel(config, layer_idx, backend, mapping)
    _load(model, model_dir, load_format)
    model.embed_tokens = embed_tokens
    return model.eval()


def _random_init(model: torch.nn.Module, seed: int, std: float) -> torch.nn.Module:
    """Norms at scale 1 (``weight + weight_offset == 1``), every other parameter N(0, std), from one
    seeded generator; buffers (the MoE's score-correction bias) stay 0."""
    generator = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner = modules[name.rpartition(".")[0]]
            offset = getattr(owner, "weight_offset", None)
            if offset is not None:
                param.fill_(1.0 - offset)
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
    config: ModelConfig,
    seed: int = 0,
    std: float = 0.02,
    attn_backend: str = "VANILLA",
    **model_options,
) -> torch.nn.Module:
    """A randomly initialised model of the class ``config.architectures[0]`` selects (tests, and
    the starting point of training); ``model_options``: its constructor's (``num_mtp_modules``)."""
    model_class = get_model_classes(config.architectures[0]).model_class
    model = model_class(config, get_attention_backend(attn_backend), **model_options)
    return _random_init(model, seed, std)
