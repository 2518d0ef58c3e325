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
import functools
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tensorrt_llm._torch.attention_backend.utils import get_attention_backend
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.config_utils import read_config_json
from tensorrt_llm._torch.models.modeling_speculative import (
    Eagle3Config,
    Eagle3DraftModel,
    Eagle3Target,
)
from tensorrt_llm._torch.models.registry import ModelConfig, architecture_of, get_model_classes
from tensorrt_llm._torch.models.weights import CheckpointLayout, Destination, is_scale
from tensorrt_llm._torch.modules.fp8.block import FP8, dequantize_weight
from tensorrt_llm._torch.modules.fp8.modules import use_fp8_block
from tensorrt_llm._torch.modules.linear import shard_weight
from tensorrt_llm.logger import logger
from tensorrt_llm.quantization import QuantAlgo

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """``model_dir``'s safetensors: its shards (``model.safetensors.index.json``), or the one."""
    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{index}: not a safetensors index with a weight_map ({exc})"
            ) from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index}: lists shards that are not there: {absent}")
        return files
    if (model_dir / WEIGHTS).is_file():
        return [model_dir / WEIGHTS]
    raise ValueError(f"model={str(model_dir)!r}: no {WEIGHTS} or {WEIGHTS_INDEX} there")


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint, with the file that holds it."""
    index = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            index.update(dict.fromkeys(f.keys(), path))
    return index


def read_tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Every tensor of the checkpoint as ``(name, get)``: ``get()`` reads it (once; the read is
    kept until the next tensor), so a caller holds at most one checkpoint tensor at a time."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, functools.cache(functools.partial(f.get_tensor, name))


def load_checkpoint_into(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Load ``model_dir``'s weights into ``model`` through its ``checkpoint_layout``, strictly.

    FP8 block-scaled weights (a ``float8_e4m3fn`` ``X.weight`` beside its ``X.weight_scale_inv``)
    are copied as they are into FP8 destinations of their whole shape; anywhere else they are
    dequantized first (the CPU, a shard of a split layer, a split tensor). A destination that is
    FP8 takes a weight of the model's dtype quantized (``fp8 == "store"``) or rounded to the FP8
    grid (``"grid"``): a checkpoint quantized at load."""
    layout: CheckpointLayout = type(model).checkpoint_layout
    tied = _untie_for_loading(model)
    destinations = layout.destinations(model)
    index = checkpoint_index(model_dir)
    seen: set[str] = set()
    unexpected: list[str] = []
    skipped: Counter[str] = Counter()
    where = f"model={str(model_dir)!r}"
    with torch.no_grad():
        for name, get in checkpoint_tensors(model_dir):
            family = layout.skipped_family(name, model)
            if family is not None:
                skipped[family] += 1
                continue
            if is_scale(name):
                if name.removesuffix("_scale_inv") not in index:
                    unexpected.append(name)
                continue  # read with its weight
            scale_name = name + "_scale_inv"
            if scale_name in index and get().dtype == FP8:
                get_scale = functools.partial(read_tensor, index[scale_name], scale_name)
                if _copy_fp8_whole(layout, destinations, name, get, get_scale, seen):
                    continue
                get = functools.cache(functools.partial(_dequantized, get, get_scale, name, where))
            for piece in layout.canonical_pieces(name, get):
                dest = destinations.get(piece.name)
                if dest is None:
                    unexpected.append(name)
                    break
                seen.add(piece.name)
                if dest.elsewhere:
                    continue
                tensor = dest.shard(piece.get())
                if tensor.shape != dest.view.shape:
                    raise ValueError(
                        f"{where}: {name} has shape {tuple(get().shape)}; this model "
                        f"expects {_full_shape_hint(piece.name, dest, tensor)}"
                    )
                dest.store(tensor)
                del tensor  # nothing of this checkpoint tensor outlives its pieces
    for family, count in sorted(skipped.items()):
        logger.info("%s: skipped %d %s.* tensor(s) (no module takes them)", where, count, family)
    missing = sorted(n for n in destinations if n not in seen)
    if tied and {HEAD, EMBED} & seen:
        missing = [n for n in missing if n not in (HEAD, EMBED)]
        _settle_tied_head(model, seen, where)
    if missing or unexpected:
        raise ValueError(
            f"{where}: {len(missing)} missing tensor(s) {missing[:8]}, "
            f"{len(unexpected)} unexpected tensor(s) {sorted(set(unexpected))[:8]}"
        )


def _copy_fp8_whole(layout, destinations, name, get, get_scale, seen) -> bool:
    """An FP8 checkpoint weight copied as it is, with its scales, when it is one canonical tensor
    whose destination stores FP8 at the same shape. Returns whether it was."""
    pieces = layout.canonical_pieces(name, get)
    if len(pieces) != 1 or pieces[0].name not in destinations:
        return False
    dest = destinations[pieces[0].name]
    if dest.elsewhere:
        seen.add(pieces[0].name)
        return True
    weight = pieces[0].get()
    if dest.fp8 != "store" or weight.shape != dest.view.shape:
        return False
    scale = get_scale()
    if scale.shape != dest.scale.shape:
        raise ValueError(
            f"{name}_scale_inv has shape {tuple(scale.shape)}; a weight of "
            f"{tuple(weight.shape)} takes {tuple(dest.scale.shape)} (blocks of 128)"
        )
    dest.view.copy_(weight)
    dest.scale.copy_(scale)
    seen.add(pieces[0].name)
    return True


def _dequantized(get, get_scale, name: str, where: str) -> torch.Tensor:
    try:
        return dequantize_weight(get(), get_scale())
    except ValueError as exc:
        raise ValueError(f"{where}: {name}: {exc}") from None


def _full_shape_hint(name: str, dest: Destination, shard: torch.Tensor) -> str:
    return f"{name} of shape {tuple(dest.view.shape)} on this rank (got {tuple(shard.shape)})"


HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _untie_for_loading(model: torch.nn.Module) -> bool:
    """Whether the config ties the LM head to the embedding. A tied head gets a tensor of its own
    for the load (a checkpoint may store both, and they may differ); ``_settle_tied_head`` ties
    them back."""
    if not model.config.tie_word_embeddings:
        return False
    head, embed = model.lm_head, model.model.embed_tokens
    if head.weight is embed.weight:
        head.weight = torch.nn.Parameter(torch.empty_like(embed.weight), requires_grad=False)
    return True


@torch.no_grad()
def _settle_tied_head(model: torch.nn.Module, seen: set[str], where: str) -> None:
    """After a tied checkpoint's load (one of the two tensors at least was in it), as transformers
    does: a missing head is the embedding (a head split over the ranks takes its shard), a
    missing embedding is the head, equal ones are shared again, and different ones stay apart."""
    head, embed = model.lm_head, model.model.embed_tokens
    split = head.weight.shape != embed.weight.shape  # vocabulary-parallel over the ranks
    if HEAD not in seen:
        if split:
            head.weight.copy_(shard_weight(head, embed.weight))
        else:
            head.weight = embed.weight
    elif EMBED not in seen:
        if split:
            raise ValueError(
                f"{where}: tie_word_embeddings with {HEAD} but no {EMBED}: a head split over "
                "the ranks cannot give the embedding"
            )
        embed.weight.copy_(head.weight)
        head.weight = embed.weight
    elif not split and torch.equal(head.weight, embed.weight):
        head.weight = embed.weight
    else:
        logger.info(
            "%s: tie_word_embeddings, but %s differs from %s: served apart", where, HEAD, EMBED
        )


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
    ``model_options``: the model constructor's (MiniMax-M3's ``num_mtp_modules``)."""
    config = load_config(model_dir)
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
    _load(model, model_dir, load_format)
    return model.eval()


LOAD_FORMATS = ("auto", "dummy")


def _load(model: torch.nn.Module, model_dir: str | Path, load_format: str) -> None:
    if load_format == "auto":
        load_checkpoint_into(model, model_dir)
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
