"""The attention-backend seam: selection by upstream's names, the VANILLA backend's contract, and
model modules that reach attention only through their backend."""

import ast
from pathlib import Path

import pytest
import torch

import tensorrt_llm._torch.models as models_pkg
from tensorrt_llm._torch.attention_backend.backend import AttentionBackend
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa_backend import (
    MSA_BACKENDS,
    MsaBackend,
    msa_backend_for,
)
from tensorrt_llm._torch.attention_backend.utils import get_attention_backend
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend


def test_vanilla_is_selected_by_name_and_is_the_models_default(tiny_model):
    _, model = tiny_model
    backend = get_attention_backend("VANILLA")
    assert isinstance(backend, VanillaAttentionBackend) and backend.name == "VANILLA"
    assert isinstance(model.attn_backend, VanillaAttentionBackend)


def test_an_unknown_backend_name_is_an_error_naming_it_and_the_available_ones():
    with pytest.raises(
        ValueError, match=r"attn_backend='FLASHINFER' is unknown.*'TRITON', 'VANILLA'"
    ):
        get_attention_backend("FLASHINFER")


def test_vanilla_without_metadata_points_to_the_training_backend(tiny_model):
    cfg, model = tiny_model
    with pytest.raises(ValueError, match="use_training_backend"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_a_model_calls_the_backend_it_holds_and_its_family_msa(tiny_model, monkeypatch):
    """Dense layers call the model's attn_backend; sparse layers the MSA backend registered for
    that backend's name (``sparse/minimax_m3/msa_backend.py``), made once per backend."""
    cfg, model = tiny_model
    calls = []

    class Recording(AttentionBackend):
        name = "RECORDING"

        def attention(self, layer_idx, q, k, v, metadata, scale):
            calls.append(("dense", layer_idx))
            return torch.zeros_like(q)

    class RecordingMsa(MsaBackend):
        def attend(self, layer_idx, q, k, v, msa, metadata, cfg, scale):
            assert self.attn_backend is model.attn_backend
            calls.append(("msa", layer_idx, tuple(msa.index_q.shape), tuple(msa.index_k.shape)))
            return torch.zeros_like(q)

    monkeypatch.setitem(MSA_BACKENDS, "RECORDING", RecordingMsa)
    model.attn_backend = Recording()
    with torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long))
        model(torch.zeros(1, 5, dtype=torch.long))
    di, groups = cfg.index_head_dim, cfg.num_key_value_heads
    assert calls == 2 * [
        ("dense", 0),
        ("msa", 1, (1, 5, groups, di), (1, 5, 1, di)),
        ("msa", 2, (1, 5, groups, di), (1, 5, 1, di)),
    ]
    assert msa_backend_for(model.attn_backend) is msa_backend_for(model.attn_backend)


def test_a_backend_without_an_msa_is_refused_by_name(tiny_model):
    _, model = tiny_model

    class DenseOnly(AttentionBackend):
        name = "DENSE_ONLY"

        def attention(self, layer_idx, q, k, v, metadata, scale):
            return torch.zeros_like(q)

    model.attn_backend = DenseOnly()
    with pytest.raises(ValueError, match="attn_backend='DENSE_ONLY' has no MiniMax-M3 sparse"):
        model(torch.zeros(1, 5, dtype=torch.long))


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
