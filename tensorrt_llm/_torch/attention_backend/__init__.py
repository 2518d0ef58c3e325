from tensorrt_llm._torch.attention_backend.trtllm import TrtllmAttentionMetadata

__all__ = ["TrtllmAttentionMetadata"]
