from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata

__all__ = ["AttentionMetadata"]
