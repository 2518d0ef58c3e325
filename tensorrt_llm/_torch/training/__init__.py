"""Training-only paths, kept out of the inference modules: the no-cache attention backend (with
MSA's dense warm-up and indexer loss) and Eagle3's training-time test."""

from tensorrt_llm._torch.training.backend import TrainingAttentionBackend, use_training_backend
from tensorrt_llm._torch.training.eagle3_ttt import ttt_logits
from tensorrt_llm._torch.training.msa_dense import msa_dense_attention

__all__ = [
    "TrainingAttentionBackend",
    "msa_dense_attention",
    "ttt_logits",
    "use_training_backend",
]
