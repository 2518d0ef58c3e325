"""The attention-backend seam: selection by upstream's names, the VANILLA backend's contract, and
model modules that reach attention only through their backend."""

import ast
from pathlib import Path

import pytest
import torch

import tensorrt_llm._torch.attention_backend.utils as attention_utils
import tensorrt_llm._torch.models as models_pkg
from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.utils import get_attention_backend
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend


def test_vanilla_is_selected_by_name_and_is_the_models_default(tiny_model):
    _, model = tiny_model
    backend = get_attention_backend("VANILLA")
    assert isinstance(backend, VanillaAttentionBackend) and backend.name == "VANILLA"
    assert isinstance(model.attn_backend, VanillaAttentionBackend)


def test_an_unknown_backend_name_is_an_error_naming_it_and_the_known_ones():
    with pytest.raises(
        ValueError, match=r"attn_backend='FLASHINFER' is unknown.*'TRITON'.*'VANILLA'"
    ):
        get_attention_backend("FLASHINFER")


def test_a_planned_backend_is_an_error_until_it_exists(monkeypatch):
    monkeypatch.setattr(attention_utils, "PLANNED_ATTENTION_BACKENDS", ("FLASHINFER",))
    with pytest.raises(
        ValueError, match=r"attn_backend='FLASHINFER' is not available yet.*'TRITON', 'VANILLA'"
    ):
        get_attention_backend("FLASHINFER")


def test_vanilla_without_metadata_points_to_the_training_backend(tiny_model):
    cfg, model = tiny_model
    with pytest.raises(ValueError, match="use_training_backend"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_a_model_calls_the_backend_it_holds(tiny_model):
    cfg, model = tiny_model

    class Recording(AttentionBackend):
        name = "RECORDING"

        def __init__(self):
            self.calls = []

        def attention(self, layer_idx, q, k, v, metadata, scale):
            self.calls.append(("dense", layer_idx))
            return torch.zeros_like(q)

        def msa_attention(self, layer_idx, q, k, v, msa, metadata, cfg, scale):
            self.calls.append(("msa", layer_idx, tuple(msa.index_k.shape)))
            return torch.zeros_like(q)

    model.attn_backend = Recording()
    with torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long))
    di = cfg.sparse_attention_config.index_head_dim
    assert model.attn_backend.calls == [
        ("dense", 0),
        ("msa", 1, (1, 5, 1, di)),
        ("msa", 2, (1, 5, 1, di)),
    ]


ATTENTION_OPS = {
    "paged_attention",
    "causal_attention",
    "msa_paged_attention",
    "sparse_attention",
    "msa_dense_attention",
}


def test_model_modules_import_no_attention_op():
    """Models hold a backend; an attention function imported into a model file bypasses it."""
    offenders = []
    for path in Path(models_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = {alias.name for alias in node.names}
                module = node.module or ""
                if names & ATTENTION_OPS or module.endswith(("reference", "vanilla")):
                    offenders.append(f"{path.name}: from {module} import {sorted(names)}")
    assert offenders == []
