"""The training backend: installed for a block and restored after it, whole sequences only, and the
indexer loss as its own state."""

import pytest
import torch
from m3_helpers import m3_manager

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.training import TrainingAttentionBackend, use_training_backend


def test_the_previous_backend_comes_back_after_the_block_even_on_error(tiny_model):
    _, model = tiny_model
    before = model.attn_backend
    with pytest.raises(RuntimeError, match="boom"), use_training_backend(model) as backend:
        assert model.attn_backend is backend and isinstance(backend, TrainingAttentionBackend)
        raise RuntimeError("boom")
    assert model.attn_backend is before


def test_a_module_without_a_backend_is_refused():
    with (
        pytest.raises(TypeError, match="Linear holds no attn_backend"),
        use_training_backend(torch.nn.Linear(2, 2)),
    ):
        pass


def test_the_training_backend_refuses_paged_metadata(tiny_model):
    cfg, model = tiny_model
    manager = m3_manager(cfg)
    manager.add_sequence(0, [1, 2, 3])
    manager.resize_sequence(0, 3)
    md = AttentionMetadata(manager, [0], [3], [0], num_contexts=1)
    with pytest.raises(ValueError, match="without attn_metadata"), use_training_backend(model):
        model(torch.tensor([1, 2, 3]), attn_metadata=md)


def test_the_indexer_loss_is_summed_over_msa_layers_only_when_asked(tiny_model):
    cfg, model = tiny_model
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with use_training_backend(model) as backend:
        model(ids)
        assert backend.indexer_loss == 0.0
    with use_training_backend(model, msa_sparse=False, train_indexer=True) as backend:
        model(ids)
        loss = backend.indexer_loss
        assert torch.is_tensor(loss) and loss.requires_grad and float(loss.detach()) > 0
        assert sorted(backend.indexer_losses) == list(cfg.sparse_layer_ids)
        backend.train_indexer = False
        model(ids)
        assert backend.indexer_loss == 0.0


def test_dense_warm_up_differs_from_sparse_msa_beyond_top_k_blocks(tiny_model):
    cfg, model = tiny_model
    msa = cfg.msa
    length = (msa.topk_blocks + 2) * msa.block_size
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), use_training_backend(model, msa_sparse=False) as backend:
        dense, _ = model(ids)
        backend.msa_sparse = True
        sparse, _ = model(ids)
    fits = msa.topk_blocks * msa.block_size  # every block selected up to here: identical
    torch.testing.assert_close(sparse[0, :fits], dense[0, :fits])
    assert not torch.allclose(sparse[0, fits:], dense[0, fits:], atol=1e-4)
