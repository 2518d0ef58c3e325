"""Which layers of a model take FP8 block scales, and how (``linear.Fp8BlockLinear``)."""

from __future__ import annotations

from torch import nn

from tensorrt_llm._torch.modules.linear import Fp8BlockLinear
from tensorrt_llm._torch.modules.moe import StackedExperts

# The checkpoint's prefixes and infixes that name our modules differently (``modules_to_not_convert``
# is matched against module names as transformers matches it: a substring).
_RENAMES = (("language_model.", ""), ("block_sparse_moe", "mlp"))


def use_fp8_block(
    model: nn.Module, modules_to_not_convert: tuple[str, ...], store: bool
) -> list[str]:
    """Mark the attention projections, the dense MLPs (the shared expert included) and the expert
    stacks of ``model`` FP8, except the LM head and the modules ``modules_to_not_convert`` names:
    with ``store`` they hold FP8 weights and block scales (CUDA), else their weights are rounded
    to the FP8 grid at load (the CPU). Returns the names marked. Call before loading."""
    skip = [_canonical(key) for key in modules_to_not_convert]
    marked = []
    for name, module in model.named_modules():
        if not isinstance(module, Fp8BlockLinear | StackedExperts) or name.endswith("lm_head"):
            continue
        if any(key in name for key in skip):
            continue
        if store:
            module.to_fp8_block()
        else:
            module.fp8_block = "grid"
        marked.append(name)
    return marked


def _canonical(key: str) -> str:
    for old, new in _RENAMES:
        key = key.replace(old, new)
    return key
