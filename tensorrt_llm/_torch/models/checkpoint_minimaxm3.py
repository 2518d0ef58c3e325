"""MiniMax-M3 checkpoints: the hub layout and transformers' own, onto ``modeling_minimaxm3.py``.

Every checkpoint tensor is mapped to **canonical names**: this model's parameter names, except that
the stacked experts are named one expert at a time as the hub names them
(``...mlp.experts.{e}.w1/w3/w2.weight``: gate, up, down) and fused gate/up tensors are split::

    hub (MiniMaxM3SparseForConditionalGeneration)       canonical (model.layers.N. ...)
    language_model.model.layers.N.<x>                   <x>, with:
      block_sparse_moe.gate.weight                        mlp.gate.weight
      block_sparse_moe.e_score_correction_bias            mlp.e_score_correction_bias
      block_sparse_moe.experts.{e}.w1/w3/w2.weight        mlp.experts.{e}.w1/w3/w2.weight
      block_sparse_moe.shared_experts.*                   mlp.shared_experts.*
      self_attn.index_{q,k}_{proj,norm}.weight            (the same)
    language_model.model.{embed_tokens,norm}            model.{embed_tokens,norm}
    language_model.lm_head.weight                       lm_head.weight

    transformers (MiniMaxM3VLForCausalLM)               canonical
    model.layers.N.mlp.experts.gate_up_proj [E, 2I, H]  mlp.experts.{e}.w1 (rows :I), w3 (I:)
    model.layers.N.mlp.experts.down_proj [E, H, I]      mlp.experts.{e}.w2
    model.layers.N.mlp.gate.e_score_correction_bias     mlp.e_score_correction_bias
    ...mlp.gate_up_proj.weight, ...shared_experts.gate_up_proj.weight [2I, H]
                                                        ...gate_proj (rows :I), ...up_proj (I:)
    model.layers.N.self_attn.indexer.{q,k}_{proj,norm}  self_attn.index_{q,k}_{proj,norm}

The vision side (``modeling_minimaxm3_vision.py``)::

    hub                                                 canonical (= transformers' less ``model.``)
    vision_tower.vision_model.embeddings.patch_embedding  vision_tower.embeddings.proj
    vision_tower.vision_model.encoder.layers.N          vision_tower.layers.N
    vision_tower.vision_model.pre_layrnorm              vision_tower.pre_layrnorm
    multi_modal_projector.linear_{1,2}                  multi_modal_projector.linear_{1,2}
    patch_merge_mlp.linear_{1,2}                        multi_modal_projector.merge_linear_{1,2}

A text-only model (no ``vision_config``) skips them, one log line per family, as a model without
MTP modules skips ``mtp`` (``language_model.model.mtp.layers.{i}.*``: ``modeling_minimaxm3_mtp.py``,
their MoE renamed as a layer's). Each canonical name has one destination on this
rank: a view of a parameter and the rank's shard of the full tensor (``shard_weight``). The loader
itself (files, shards, strictness, the tied LM head) is ``checkpoint.py``'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from tensorrt_llm._torch.models.weights import (
    ELSEWHERE,
    Destination,
    Piece,
    is_scale,
    plain_destination,
)
from tensorrt_llm._torch.modules.fp8.block import scale_shape
from tensorrt_llm._torch.modules.moe import StackedExperts

SKIPPED_FAMILIES = re.compile(r"(?:^|\.)(mtp)\.")
VISION_FAMILIES = re.compile(r"^(?:model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.")
_PREFIXES = (  # checkpoint prefix -> canonical prefix
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("vision_tower.vision_model.embeddings.patch_embedding.", "vision_tower.embeddings.proj."),
    ("vision_tower.vision_model.encoder.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("patch_merge_mlp.linear_", "multi_modal_projector.merge_linear_"),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_HUB_VISION = (  # canonical prefix -> hub prefix
    ("vision_tower.embeddings.proj.", "vision_tower.vision_model.embeddings.patch_embedding."),
    ("vision_tower.layers.", "vision_tower.vision_model.encoder.layers."),
    ("vision_tower.", "vision_tower.vision_model."),
    ("multi_modal_projector.merge_linear_", "patch_merge_mlp.linear_"),
    ("multi_modal_projector.", "multi_modal_projector."),
)
_RENAMES = (  # within a layer, checkpoint infix -> canonical infix
    (".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias"),
    (".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),
    (".block_sparse_moe.", ".mlp."),
    (".self_attn.indexer.", ".self_attn.index_"),
)
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_GATE_UP = re.compile(r"^(.*)\.gate_up_proj\.weight$")


class MiniMaxM3CheckpointLayout:
    """How MiniMax-M3 checkpoints name this model's tensors (the module docstring)."""

    @staticmethod
    def skipped_family(name: str, model: torch.nn.Module) -> str | None:
        """The MTP modules' tensors when the model builds none, the vision side's when the
        model is text-only."""
        match = None if hasattr(model.model, "mtp") else SKIPPED_FAMILIES.search(name)
        if match is None and model.config.vision is None:
            match = VISION_FAMILIES.search(name)
        return match.group(1) if match else None

    @staticmethod
    def canonical_pieces(name: str, get: Callable[[], torch.Tensor]) -> list[Piece]:
        """The canonical names a checkpoint tensor holds, each with a getter of its part."""
        for prefix, canonical in _PREFIXES:
            if name.startswith(prefix):
                name = canonical + name[len(prefix) :]
                break
        for old, new in _RENAMES:
            name = name.replace(old, new)
        experts = _EXPERTS.match(name)
        if experts:
            base, kind = experts.groups()
            return _split_experts(base, kind, get)
        fused = _GATE_UP.match(name)
        if fused:
            base = fused.group(1)
            return [
                Piece(f"{base}.gate_proj.weight", lambda: get().chunk(2, dim=0)[0]),
                Piece(f"{base}.up_proj.weight", lambda: get().chunk(2, dim=0)[1]),
            ]
        return [Piece(name, get)]

    @staticmethod
    def destinations(model: torch.nn.Module) -> dict[str, Destination]:
        """Every canonical name this rank's ``model`` loads, with where it goes."""
        modules = dict(model.named_modules())
        out: dict[str, Destination] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if is_scale(name):
                continue
            owner, _, leaf = name.rpartition(".")
            module = modules[owner]
            if isinstance(module, StackedExperts):
                out.update(_expert_destinations(owner, leaf, module))
            else:
                out[name] = plain_destination(module, name, tensor)
        return out

    @staticmethod
    def checkpoint_name(canonical: str, config) -> str:
        """The hub checkpoint's name of a canonical tensor (``MiniMaxM3SparseForConditionalGeneration``)."""
        if canonical.startswith("lm_head."):
            return "language_model." + canonical
        for prefix, hub in _HUB_VISION:
            if canonical.startswith(prefix):
                return hub + canonical[len(prefix) :]
        match = re.match(r"^model\.layers\.(\d+)\.mlp\.(.*)$", canonical)
        if match and int(match.group(1)) in config.moe_layer_ids:
            canonical = f"model.layers.{match.group(1)}.block_sparse_moe.{match.group(2)}"
        mtp = re.match(r"^(model\.mtp\.layers\.\d+\.transformer_layer)\.mlp\.(.*)$", canonical)
        if mtp:  # (an MTP module's MLP is always an MoE)
            canonical = f"{mtp.group(1)}.block_sparse_moe.{mtp.group(2)}"
        return "language_model." + canonical


def _split_experts(base: str, kind: str, get: Callable[[], torch.Tensor]) -> list[Piece]:
    """transformers' stacked experts: ``gate_up_proj [E, 2I, H]`` or ``down_proj [E, H, I]``."""
    num_experts = get().shape[0]
    if kind == "down_proj":
        return [Piece(f"{base}.{e}.w2.weight", _part(get, e)) for e in range(num_experts)]
    pieces = []
    for e in range(num_experts):
        pieces.append(Piece(f"{base}.{e}.w1.weight", _part(get, e, 0)))
        pieces.append(Piece(f"{base}.{e}.w3.weight", _part(get, e, 1)))
    return pieces


def _part(get: Callable[[], torch.Tensor], expert: int, half: int | None = None):
    def piece() -> torch.Tensor:
        tensor = get()[expert]
        return tensor if half is None else tensor.chunk(2, dim=0)[half]

    return piece


def _expert_destinations(
    owner: str, leaf: str, experts: StackedExperts
) -> Iterator[tuple[str, Destination]]:
    """``w13 [E, 2I_local, H]`` takes each expert's gate (w1) and up (w3) row shards; ``w2 [E, H,
    I_local]`` each expert's down (w2) column shard."""
    inter = experts.local_intermediate
    tp, rank = experts.tp_size, experts.tp_rank
    data = getattr(experts, leaf).data
    fp8 = experts.fp8_block
    scales = getattr(experts, f"{leaf}_scale_inv") if fp8 == "store" else None
    gate_blocks = scale_shape(inter, 1)[0]
    held = range(experts.expert_start, experts.expert_start + experts.num_experts)
    if held.stop > experts.num_global_experts:  # else some of this rank's would never load
        raise ValueError(f"{owner}: experts {held} of {experts.num_global_experts} on this rank")
    for g in range(experts.num_global_experts):  # the checkpoint's expert ids
        e = g - experts.expert_start  # this rank's
        if g not in held:
            names = ("w1", "w3") if leaf == "w13" else ("w2",)
            yield from ((f"{owner}.{g}.{n}.weight", ELSEWHERE) for n in names)
        elif leaf == "w13":
            rows = _shard_fn(tp, rank, dim=0)
            gate_s, up_s = (
                (None, None)
                if scales is None
                else (scales[e, :gate_blocks], scales[e, gate_blocks:])
            )
            yield f"{owner}.{g}.w1.weight", Destination(data[e, :inter], rows, gate_s, fp8)
            yield f"{owner}.{g}.w3.weight", Destination(data[e, inter:], rows, up_s, fp8)
        else:
            down_s = None if scales is None else scales[e]
            yield (
                f"{owner}.{g}.w2.weight",
                Destination(data[e], _shard_fn(tp, rank, dim=1), down_s, fp8),
            )


def _shard_fn(tp: int, rank: int, dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if tp == 1:
        return lambda full: full
    return lambda full: full.chunk(tp, dim=dim)[rank]
