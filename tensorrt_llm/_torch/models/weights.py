"""How a model class names its checkpoint tensors: ``CheckpointLayout`` (the loader is
``checkpoint.py``'s).

A layout maps each checkpoint tensor to one or more **canonical names** (``Piece``: a name and a
getter of its part) and says where each canonical name goes on this rank (``Destination``: a view of
a parameter, and the function that cuts this rank's shard out of the full tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tensorrt_llm._torch.modules.fp8.block import dequantize_weight, quantize_weight
from tensorrt_llm._torch.modules.linear import Fp8BlockLinear, shard_weight


@dataclass(frozen=True)
class Piece:
    """A canonical tensor a checkpoint tensor holds (all of it or a part), read on demand."""

    name: str
    get: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Destination:
    """Where a canonical tensor goes on this rank: ``shard(full)`` is copied into ``view``. A
    weight of FP8 block scales (``fp8 == "store"``) also fills ``scale``, a view of its
    ``..._scale_inv`` buffer; ``fp8 == "grid"`` rounds the values to the FP8 grid in the model's
    dtype (``linear.Fp8BlockLinear``)."""

    view: torch.Tensor | None  # None: another rank's tensor (an expert it holds), not read here
    shard: Callable[[torch.Tensor], torch.Tensor]
    scale: torch.Tensor | None = None
    fp8: str | None = None

    @property
    def elsewhere(self) -> bool:
        return self.view is None

    def store(self, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (this rank's shard, of the view's shape) in: quantized to FP8 with its
        block scales, rounded to the FP8 grid, or as it is, as ``fp8`` says."""
        if self.fp8 == "store":
            weight, scale = quantize_weight(tensor)
            self.view.copy_(weight)
            self.scale.copy_(scale)
        elif self.fp8 == "grid":
            self.view.copy_(dequantize_weight(*quantize_weight(tensor)))
        else:
            self.view.copy_(tensor)


class CheckpointLayout(Protocol):
    @staticmethod
    def skipped_family(name: str, model: torch.nn.Module) -> str | None:
        """The family a tensor of a part ``model`` does not serve belongs to (skipped), else
        None."""

    @staticmethod
    def canonical_pieces(name: str, get: Callable[[], torch.Tensor]) -> list[Piece]: ...

    @staticmethod
    def destinations(model: torch.nn.Module) -> dict[str, Destination]: ...

    @staticmethod
    def checkpoint_name(canonical: str, config) -> str:
        """The name ``save_pretrained`` writes a canonical tensor under."""


class PlainLayout:
    """Checkpoint names are the model's ``state_dict`` names (the Eagle3 drafter, the tests)."""

    @staticmethod
    def skipped_family(name: str, model: torch.nn.Module) -> str | None:
        return None

    @staticmethod
    def canonical_pieces(name: str, get: Callable[[], torch.Tensor]) -> list[Piece]:
        return [Piece(name, get)]

    @staticmethod
    def checkpoint_name(canonical: str, config) -> str:
        return canonical

    @staticmethod
    def destinations(model: torch.nn.Module) -> dict[str, Destination]:
        modules = dict(model.named_modules())
        return {
            name: plain_destination(modules[name.rpartition(".")[0]], name, tensor)
            for name, tensor in model.state_dict(keep_vars=True).items()
            if not is_scale(name)
        }


def is_scale(name: str) -> bool:
    """A block-scale buffer: loaded with its weight (``Destination.scale``), not on its own."""
    return name.endswith("_scale_inv")


def plain_destination(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> Destination:
    """A parameter or buffer of ``module`` loaded whole, or, a weight of a tensor-parallel linear
    layer, as this rank's shard (``shard_weight``), with its block scales when it is FP8."""
    if name.endswith(".weight"):
        fp8 = module.fp8_block if isinstance(module, Fp8BlockLinear) else None
        scale = module.weight_scale_inv if fp8 == "store" else None
        return Destination(tensor.data, functools.partial(shard_weight, module), scale, fp8)
    return Destination(tensor.data, _whole)


def _whole(full: torch.Tensor) -> torch.Tensor:
    return full


# a checkpoint tensor another rank holds (expert parallelism): counted as seen, never read
ELSEWHERE = Destination(None, lambda full: full)
