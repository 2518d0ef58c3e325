"""The model on the paged cache equals the plain full-sequence forward (the training backend), with
sparse layers whose selection really drops blocks (42 tokens: 6 index blocks, 3 kept)."""

import random
from collections import deque

import pytest
import torch
from m3_helpers import m3_manager

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.training import use_training_backend


def paged_step(model, manager, request_id, tokens, num_cached):
    """Run ``tokens`` of one sequence at positions ``num_cached ..`` through the paged path."""
    assert manager.resize_sequence(request_id, num_cached + len(tokens))
    md = AttentionMetadata(manager, [request_id], [len(tokens)], [num_cached], num_contexts=1)
    hidden, _ = model(torch.tensor(tokens), attn_metadata=md)
    return model.compute_logits(hidden)


def scatter_free_slots(manager, seed=0):
    free = list(manager.impl._pool._free)
    random.Random(seed).shuffle(free)
    manager.impl._pool._free = deque(free)


@pytest.mark.parametrize("chunks", [[30], [7, 9, 14]])
def test_paged_prefill_and_decode_equal_the_full_forward(tiny_model, chunks):
    cfg, model = tiny_model
    seq = torch.randint(0, cfg.vocab_size, (1, 42), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), use_training_backend(model):
        hidden, _ = model(seq)
        full = model.compute_logits(hidden)[0]  # [42, vocab]
    with torch.no_grad():
        manager = m3_manager(cfg)
        scatter_free_slots(manager)
        tokens = seq[0].tolist()
        manager.add_sequence(0, tokens[:30])
        paged, done = [], 0
        for n in chunks:  # prefill, possibly chunked
            paged.append(paged_step(model, manager, 0, tokens[done : done + n], done))
            done += n
        for t in range(done, 42):  # token-by-token decode
            paged.append(paged_step(model, manager, 0, tokens[t : t + 1], t))
        table = manager.get_batch_cache_indices([0])[0]
    assert table != sorted(table) and len(table) == 11  # really scattered, non-contiguous slots
    torch.testing.assert_close(torch.cat(paged), full, rtol=1e-4, atol=1e-4)


def test_a_batch_of_mixed_sequences_equals_each_alone(tiny_model):
    cfg, model = tiny_model
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 33, 17)]
    manager = m3_manager(cfg)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            manager.add_sequence(i, p)
            manager.resize_sequence(i, len(p))
        md = AttentionMetadata(
            manager, [0, 1, 2], [len(p) for p in prompts], [0, 0, 0], num_contexts=3
        )
        hidden, _ = model(torch.tensor(sum(prompts, [])), attn_metadata=md)
        batched = model.compute_logits(hidden).split([len(p) for p in prompts])
        with use_training_backend(model):
            alone = [model(torch.tensor([p]))[0] for p in prompts]
        for got, hidden in zip(batched, alone):
            torch.testing.assert_close(got, model.compute_logits(hidden)[0], rtol=1e-4, atol=1e-4)
