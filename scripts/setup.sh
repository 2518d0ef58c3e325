#!/usr/bin/env bash
# Creates .venv (if missing) and installs tensorrt_llm with its test extras, from scratch.
# torch: an already-installed build is kept (a GPU image brings its own); otherwise the CPU build
# named by TORCH_SPEC is installed (a bare "torch" requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
