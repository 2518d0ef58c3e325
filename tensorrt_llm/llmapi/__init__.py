from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig

__all__ = ["Eagle3DecodingConfig", "KvCacheConfig"]
