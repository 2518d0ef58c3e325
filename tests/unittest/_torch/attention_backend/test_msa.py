"""MSA through the paged cache: equal to dense attention while everything is selected, and equal to
an independent masked-dense reference (written here with plain loops, after transformers'
``MiniMaxM3VLIndexer``) beyond that, each KV group attending its own blocks."""

import math

import pytest
import torch
from m3_helpers import m3_manager, tiny_config

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.reference import causal_attention
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (
    MsaConfig,
    MsaInputs,
    index_block_scores,
    select_blocks,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa_backend import msa_backend_for
from tensorrt_llm._torch.attention_backend.utils import get_attention_backend

CFG = tiny_config()
MSA = CFG.msa  # 8-token blocks, top-3 with the local one
LAYER = 1  # a sparse layer
H, HKV, D, DI = 4, 2, 8, 8
SCALE = 1 / math.sqrt(D)
BACKEND = msa_backend_for(get_attention_backend("VANILLA"))


def reference_msa(q, k, v, iq, ik, positions, cfg=MSA):
    """Per query position p and KV group g: raw dot products of index head g with every key j <= p,
    max-pooled per block; the local blocks forced in; the top-k blocks (forced ones counted, ties
    to the earlier block); softmax attention of group g's heads over those blocks' keys."""
    q, k, v, iq, ik = (t.double() for t in (q, k, v, iq, ik))
    out = torch.zeros(len(positions), H, D, dtype=torch.float64)
    bs = cfg.block_size
    for row, p in enumerate(positions):
        last = p // bs
        for g in range(HKV):
            score = [float(iq[row, g] @ ik[j, 0]) for j in range(p + 1)]
            block = {b: max(score[b * bs : min((b + 1) * bs, p + 1)]) for b in range(last + 1)}
            forced = {max(last - i, 0) for i in range(cfg.local_blocks)}
            ranked = sorted(block, key=lambda b: (b not in forced, -block[b], b))
            chosen = set(ranked[: cfg.topk_blocks])
            keys = [j for j in range(p + 1) if j // bs in chosen]
            for h in range(g * (H // HKV), (g + 1) * (H // HKV)):
                logits = torch.stack([q[row, h] @ k[j, g] for j in keys]) * SCALE
                weights = torch.softmax(logits, dim=0)
                out[row, h] = sum(w * v[j, g] for w, j in zip(weights, keys))
    return out.float()


def random_inputs(length, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = dict(
        q=(length, H, D),
        k=(length, HKV, D),
        v=(length, HKV, D),
        iq=(length, HKV, DI),
        ik=(length, 1, DI),
    )
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def run_paged(x, manager, request_id, start, end):
    """Positions [start, end) of a sequence as one step (earlier ones already cached)."""
    assert manager.resize_sequence(request_id, end)
    md = AttentionMetadata(manager, [request_id], [end - start], [start], num_contexts=1)
    part = {n: t[start:end] for n, t in x.items()}
    msa = MsaInputs(index_q=part["iq"], index_k=part["ik"])
    return BACKEND.attend(LAYER, part["q"], part["k"], part["v"], msa, md, MSA, SCALE)


def dense(x):
    pos = torch.arange(x["q"].shape[0])
    return causal_attention(x["q"], x["k"], x["v"], pos, SCALE)


def test_msa_equals_dense_while_the_context_fits_in_top_k_blocks():
    length = MSA.topk_blocks * MSA.block_size  # 24 tokens: every block is selected
    x = random_inputs(length, seed=3)
    manager = m3_manager(CFG)
    manager.add_sequence(0, list(range(length)))
    torch.testing.assert_close(run_paged(x, manager, 0, 0, length), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [17, 50, 97])
def test_msa_beyond_top_k_blocks_matches_the_masked_dense_reference(length):
    x = random_inputs(length, seed=length)
    manager = m3_manager(CFG)
    manager.add_sequence(0, list(range(length)))
    got = run_paged(x, manager, 0, 0, length)
    torch.testing.assert_close(
        got, reference_msa(*x.values(), positions=range(length)), rtol=1e-4, atol=1e-4
    )
    if length >= 4 * MSA.block_size:
        assert not torch.allclose(got, dense(x), atol=1e-3)  # really sparse


def test_every_verify_token_selects_its_own_blocks():
    length = 61
    x = random_inputs(length, seed=7)
    manager = m3_manager(CFG)
    manager.add_sequence(0, list(range(length)))
    run_paged(x, manager, 0, 0, 57)  # prefill
    got = run_paged(x, manager, 0, 57, 61)  # a generation step: last token + 3 drafts
    want = reference_msa(
        *(t[57:61] if n in ("q", "iq") else t for n, t in x.items()), positions=range(57, 61)
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_each_kv_group_selects_its_own_blocks():
    """Two groups whose index heads favour different blocks select different blocks: a query of
    group 0 attends block 1, one of group 1 block 2 (besides the local block 4)."""
    cfg = MsaConfig(num_index_heads=2, index_head_dim=2, block_size=8, topk_blocks=2)
    ik = torch.zeros(40, 2)
    ik[8:16, 0] = 1.0  # block 1 answers index head 0
    ik[16:24, 1] = 1.0  # block 2 answers index head 1
    iq = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # one query at position 39: [n=1, G=2, 2]
    pos = torch.tensor([39])
    selected = select_blocks(index_block_scores(iq, ik, pos, 8), pos, cfg)
    assert selected[0].nonzero().tolist() == [[0, 1], [0, 4], [1, 2], [1, 4]]


@pytest.mark.parametrize("local_blocks", [0, 1, 2])
def test_the_forced_local_blocks_count_towards_top_k(local_blocks):
    cfg = MsaConfig(2, 4, block_size=4, topk_blocks=3, local_blocks=local_blocks)
    scores = torch.arange(6.0).flip(0).expand(1, 2, 6).clone()  # block 0 best, block 5 worst
    selected = select_blocks(scores, torch.tensor([22]), cfg)  # query in block 5
    want = {0: [0, 1, 2], 1: [0, 1, 5], 2: [0, 4, 5]}[local_blocks]
    assert selected[0, 0].nonzero().flatten().tolist() == want
    assert selected[0, 1].sum() == 3
