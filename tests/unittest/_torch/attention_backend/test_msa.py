"""MSA through the paged cache: equal to dense attention while everything is selected, and equal to
an independent masked-dense reference (written here with plain loops) beyond that."""

import math

import pytest
import torch
from m3_helpers import m3_manager, tiny_config

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.reference import causal_attention
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import MsaInputs
from tensorrt_llm._torch.attention_backend.utils import get_attention_backend

CFG = tiny_config()
MSA = CFG.sparse_attention_config  # block 8, top-2 blocks, 1 local block
LAYER = 1  # a sparse layer
H, HKV, D, HI, DI = 4, 2, 8, 2, 8
SCALE = 1 / math.sqrt(D)
BACKEND = get_attention_backend("VANILLA")


def reference_msa(q, k, v, iq, iw, ik, positions):
    """Per query position p: score every key j <= p, max-pool per block, keep the local block and the
    top-k earlier blocks (ties to the earlier block), then softmax attention over their keys."""
    q, k, v, iq, iw, ik = (t.double() for t in (q, k, v, iq, iw, ik))
    out = torch.zeros(len(positions), H, D, dtype=torch.float64)
    bs = MSA.block_size
    for row, p in enumerate(positions):
        score = [
            sum(iw[row, h] * max(0.0, float(iq[row, h] @ ik[j, 0])) for h in range(HI))
            / math.sqrt(DI)
            for j in range(p + 1)
        ]
        last = p // bs
        block_score = {b: max(score[b * bs : min((b + 1) * bs, p + 1)]) for b in range(last + 1)}
        local = {b for b in block_score if b > last - MSA.num_local_blocks}
        earlier = sorted(
            (b for b in block_score if b not in local), key=lambda b: (-block_score[b], b)
        )
        chosen = local | set(earlier[: MSA.topk_blocks])
        keys = [j for j in range(p + 1) if j // bs in chosen]
        for h in range(H):
            g = h // (H // HKV)
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
        iq=(length, HI, DI),
        iw=(length, HI),
        ik=(length, 1, DI),
    )
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def run_paged(x, manager, request_id, start, end):
    """Positions [start, end) of a sequence as one step (earlier ones already cached)."""
    assert manager.resize_sequence(request_id, end)
    md = AttentionMetadata(manager, [request_id], [end - start], [start], num_contexts=1)
    part = {n: t[start:end] for n, t in x.items()}
    msa = MsaInputs(index_q=part["iq"], index_w=part["iw"], index_k=part["ik"])
    return BACKEND.msa_attention(LAYER, part["q"], part["k"], part["v"], msa, md, MSA, SCALE)


def dense(x):
    pos = torch.arange(x["q"].shape[0])
    return causal_attention(x["q"], x["k"], x["v"], pos, SCALE)


def test_msa_equals_dense_while_the_context_fits_in_top_k_blocks():
    length = MSA.topk_blocks * MSA.block_size  # 16 tokens: every block is selected
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
        *(t[57:61] if n in ("q", "iq", "iw") else t for n, t in x.items()), positions=range(57, 61)
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
