"""Settings every unit test shares, made before anything of tensorrt_llm is imported.

- Without a GPU every Triton kernel under test runs in Triton's interpreter: ``triton.jit`` reads
  ``TRITON_INTERPRET`` when it decorates a kernel, and the first test modules collected already
  import the model layers (``_torch/modules/fused.py``).
- The tests' disaggregated deployments (in-process LLMs and server subprocesses alike) share one
  ``TRTLLM_DISAGG_SECRET``.
"""

import os

import pytest
import torch

os.environ.setdefault("TRTLLM_DISAGG_SECRET", "unit-tests-deployment-secret")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _serve_in_thread(app):
    """``app`` on a free loopback port in a uvicorn thread; returns (url, stop)."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def bundled_server():
    """A live trtllm-serve of the bundled model (Eagle3 unified, CPU) with MiniMax-M3's reasoning
    and tool parsers, as the README runs it: (OpenAIServer, base URL)."""
    from tensorrt_llm.commands.serve import build_server

    server = build_server(
        None, None, device="cpu", reasoning_parser="minimax_m3", tool_parser="minimax_m3"
    )
    url, stop = _serve_in_thread(server.app)
    yield server, url
    stop()
    server.close()


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    """A live trtllm-serve of a tiny random MiniMax-M3 with a vision tower (CPU), taking local
    images from its ``media`` directory: (OpenAIServer, base URL, media directory)."""
    import sys
    from pathlib import Path

    from tensorrt_llm.commands.serve import build_server

    sys.path.insert(0, str(Path(__file__).parent / "llmapi"))
    from llm_helpers import write_tiny_vl_checkpoint

    root = tmp_path_factory.mktemp("vl-server")
    model = write_tiny_vl_checkpoint(root / "m3-vl")
    media = root / "media"
    media.mkdir()
    server = build_server(model, None, device="cpu", allowed_local_media_path=media)
    url, stop = _serve_in_thread(server.app)
    yield server, url, media
    stop()
    server.close()


@pytest.fixture(scope="session")
def serve_in_thread():
    """``serve_in_thread(app) -> (url, stop)``: an app on a free loopback port in a thread."""
    return _serve_in_thread
