from tensorrt_llm.llmapi.llm_args import (
    CudaGraphConfig,
    Eagle3DecodingConfig,
    KvCacheConfig,
    MTPDecodingConfig,
    QuantConfig,
    TorchLlmArgs,
)


def __getattr__(name: str):
    # LLM pulls in the whole runtime; load it on first use so config imports stay light.
    if name in {"LLM", "CompletionOutput", "GenerationRequest", "RequestOutput"}:
        from tensorrt_llm.llmapi import llm

        return getattr(llm, name)
    raise AttributeError(name)


__all__ = [
    "LLM",
    "CompletionOutput",
    "CudaGraphConfig",
    "Eagle3DecodingConfig",
    "MTPDecodingConfig",
    "GenerationRequest",
    "KvCacheConfig",
    "QuantConfig",
    "RequestOutput",
    "TorchLlmArgs",
]
