"""Quantization algorithms (upstream's names) and the checkpoint format each one reads.

``FP8_BLOCK_SCALES``: DeepSeek-V3's FP8, as MiniMax-M3's FP8 checkpoints ship it: the linear
layers' weights in ``float8_e4m3fn``, each with a float32 ``weight_scale_inv`` of ``[ceil(out /
128), ceil(in / 128)]``, and the activations quantized on the fly per token per 128 channels. Its
``config.json`` says::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class QuantAlgo(StrEnum):
    FP8_BLOCK_SCALES = "FP8_BLOCK_SCALES"


# The keys of an FP8 block-scaled checkpoint's quantization_config, and the values we serve.
FP8_BLOCK_FORMAT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
_OPTIONAL = {"fmt", "modules_to_not_convert", "ignored_layers"}


def checkpoint_quantization(quant: Any, where: str) -> tuple[QuantAlgo, tuple[str, ...]]:
    """A ``quantization_config`` -> the algorithm and the modules it leaves unquantized; anything
    else than FP8 with 128 x 128 block scales is an error naming the key."""
    if not isinstance(quant, dict):
        raise ValueError(f"{where}: quantization_config={quant!r} must be an object")
    for key, want in FP8_BLOCK_FORMAT.items():
        if key not in quant and key in _OPTIONAL:
            continue
        got = quant.get(key)
        if got != want:
            raise ValueError(
                f"{where}: quantization_config.{key}={got!r} is not served; FP8 checkpoints "
                f"need {key}={want!r} (128 x 128 block scales, dynamic activations)"
            )
    unknown = sorted(set(quant) - set(FP8_BLOCK_FORMAT) - _OPTIONAL)
    if unknown:
        raise ValueError(f"{where}: quantization_config has keys {unknown} we do not serve")
    skip = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise ValueError(
            f"{where}: quantization_config.modules_to_not_convert={skip!r} must be a list of names"
        )
    return QuantAlgo.FP8_BLOCK_SCALES, tuple(skip)
