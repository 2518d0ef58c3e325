"""tensorrt_llm: a compact PyTorch-only TensorRT-LLM fork with a unified KV cache for MiniMax-M3 + Eagle3."""

from tensorrt_llm.logger import logger

__version__ = "0.1.0"

__all__ = ["logger", "__version__"]
