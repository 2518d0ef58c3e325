"""Settings every unit test shares, made before anything of tensorrt_llm is imported.

- Without a GPU every Triton kernel under test runs in Triton's interpreter: ``triton.jit`` reads
  ``TRITON_INTERPRET`` when it decorates a kernel, and the first test modules collected already
  import the model layers (``_torch/modules/fused.py``).
- The tests' disaggregated deployments (in-process LLMs and server subprocesses alike) share one
  ``TRTLLM_DISAGG_SECRET``.
"""

import os

import torch

os.environ.setdefault("TRTLLM_DISAGG_SECRET", "unit-tests-deployment-secret")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
