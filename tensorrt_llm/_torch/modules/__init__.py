"""Layers shared by every model: normalisation, rotary embedding, the gated MLP."""

from tensorrt_llm._torch.modules.gated_mlp import GatedMLP
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.modules.rotary_embedding import apply_partial_rope

__all__ = ["GatedMLP", "RMSNorm", "apply_partial_rope"]
