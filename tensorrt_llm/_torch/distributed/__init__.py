"""Several ranks, one process each: the ``Mapping`` that describes them, the collectives the model
calls (``torch.distributed``; NCCL on GPUs, gloo on the CPU) and the control plane that keeps the
ranks' executors in step."""

from tensorrt_llm._torch.distributed.mapping import Mapping

__all__ = ["Mapping"]
