"""Without a GPU the Triton kernels under test run in Triton's interpreter.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a kernel, so the variable is set here,
before any test module of this folder imports a kernel module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
