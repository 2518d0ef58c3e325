"""Without a GPU every Triton kernel under test runs in Triton's interpreter.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a kernel, and the first test modules
collected already import the model layers (``_torch/modules/fused.py``), so the variable is set
here, before anything of tensorrt_llm is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
