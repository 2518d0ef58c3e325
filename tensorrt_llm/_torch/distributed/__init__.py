"""Several ranks, one process each: the ``Mapping`` that describes them and the collectives the
model and the control plane call (``torch.distributed``; NCCL on GPUs, gloo on the CPU). The
executors that keep the ranks in step are ``_torch/executors``'."""

from tensorrt_llm._torch.distributed.mapping import Mapping

__all__ = ["Mapping"]
