"""tensorrt_llm: a compact PyTorch-only TensorRT-LLM fork with a unified KV cache for MiniMax-M3 + Eagle3."""

from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM and the configs import torch-heavy modules: load them on first use.
    if name in {
        "LLM",
        "KvCacheConfig",
        "CudaGraphConfig",
        "Eagle3DecodingConfig",
        "MTPDecodingConfig",
        "QuantConfig",
        "TorchLlmArgs",
        "RequestOutput",
        "CompletionOutput",
        "GenerationRequest",
    }:
        from tensorrt_llm import llmapi

        return getattr(llmapi, name)
    raise AttributeError(name)


__all__ = [
    "LLM",
    "CudaGraphConfig",
    "Eagle3DecodingConfig",
    "GenerationRequest",
    "GuidedDecodingParams",
    "MTPDecodingConfig",
    "KvCacheConfig",
    "QuantConfig",
    "SamplingParams",
    "TorchLlmArgs",
    "logger",
    "__version__",
]
