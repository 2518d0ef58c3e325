"""Reading HF-style safetensors checkpoints into an allocated model, strictly, one tensor at a
time (``checkpoint.py`` says how loading goes by architecture and layout)."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tensorrt_llm._torch.models.weights import CheckpointLayout, Destination, is_scale
from tensorrt_llm._torch.modules.fp8.block import FP8, dequantize_weight
from tensorrt_llm._torch.modules.linear import shard_weight
from tensorrt_llm.logger import logger

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


def load_checkpoint_into(
    model: torch.nn.Module, model_dir: str | Path, module_dirs: dict[str, Path] | None = None
) -> None:
    """Load ``model_dir``'s weights into ``model`` through its ``checkpoint_layout``, strictly.
    ``module_dirs``: a submodule's weights from a checkpoint of its own (``{"mtp": DIR}``: a
    standalone MTP checkpoint), whose other tensors (a copy of the embedding, say) are left, and
    ``model_dir``'s tensors of that family too.

    FP8 block-scaled weights (a ``float8_e4m3fn`` ``X.weight`` beside its ``X.weight_scale_inv``)
    are copied as they are into FP8 destinations of their whole shape; anywhere else they are
    dequantized first (the CPU, a shard of a split layer, a split tensor). A destination that is
    FP8 takes a weight of the model's dtype quantized (``fp8 == "store"``) or rounded to the FP8
    grid (``"grid"``): a checkpoint quantized at load."""
    layout: CheckpointLayout = type(model).checkpoint_layout
    tied = _untie_for_loading(model)
    destinations = layout.destinations(model)
    seen: set[str] = set()
    unexpected: list[str] = []
    where = f"model={str(model_dir)!r}"
    module_dirs = module_dirs or {}

    def family(name: str) -> str | None:  # the submodule of module_dirs a tensor belongs to
        return next((f for f in module_dirs if re.search(rf"(?:^|\.){f}\.", name)), None)

    sources = [(model_dir, lambda name: family(name) is None)]
    sources += [(d, lambda name, f=f: family(name) == f) for f, d in module_dirs.items()]
    with torch.no_grad():
        for source, takes in sources:
            _load_source(model, layout, destinations, source, takes, seen, unexpected)
    missing = sorted(n for n in destinations if n not in seen)
    if tied and {HEAD, EMBED} & seen:
        missing = [n for n in missing if n not in (HEAD, EMBED)]
        _settle_tied_head(model, seen, where)
    if missing or unexpected:
        raise ValueError(
            f"{where}: {len(missing)} missing tensor(s) {missing[:8]}, "
            f"{len(unexpected)} unexpected tensor(s) {sorted(set(unexpected))[:8]}"
        )


def _load_source(model, layout, destinations, model_dir, takes, seen, unexpected) -> None:
    """The tensors of checkpoint ``model_dir`` that ``takes`` into their destinations."""
    index = checkpoint_index(model_dir)
    skipped: Counter[str] = Counter()
    where = f"model={str(model_dir)!r}"
    for name, get in checkpoint_tensors(model_dir):
        if not takes(name):
            continue
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
