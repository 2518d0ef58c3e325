"""No attention path reads past the blocks a sequence holds (issue 11, item 15).

Block-table entries past a row's blocks are 0 (the view's expansion of them: slot 0's sub-pages),
so a kernel that read past a row's length would read slot 0. Here slot 0 belongs to no sequence
and holds NaN in every layer: every backend's output must stay finite, for dense, MSA and the
draft layer (through the target's table and through the view's), with launches sized by the step
and by a CUDA-graph-style ``kv_len_bound``."""

import pytest
import torch

pytest.importorskip("triton.language")

from m3_cache import DRAFT, DRAFT_KV_HEADS, HEAD_DIM, TARGET_KV_HEADS, m3_manager, step_on  # noqa: E402
from paged_case import DEVICE  # noqa: E402

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (  # noqa: E402
    MsaConfig,
    MsaInputs,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa_backend import (  # noqa: E402
    msa_backend_for,
)
from tensorrt_llm._torch.attention_backend.triton.backend import (  # noqa: E402
    TritonAttentionBackend,
)
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend  # noqa: E402

STEPS = [(0, 45), (130, 4), (255, 4)]  # a prompt chunk, then 1 + 3 token decodes
MSA = MsaConfig(TARGET_KV_HEADS, index_head_dim=8, block_size=16, topk_blocks=2, local_blocks=1)
SCALE = HEAD_DIM**-0.5


def tensors(n: int, *heads: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(n, h, HEAD_DIM, generator=g).to(DEVICE) for h in heads]


def outputs(backend, manager, md) -> dict[str, torch.Tensor]:
    n = md.num_tokens
    q, k, v = tensors(n, 2 * TARGET_KV_HEADS, TARGET_KV_HEADS, TARGET_KV_HEADS)
    iq, ik = tensors(n, TARGET_KV_HEADS, 1)  # one index head per KV group
    out = {"dense": backend.attention(0, q, k, v, md, SCALE)}
    msa = MsaInputs(index_q=iq, index_k=ik)
    out["msa"] = msa_backend_for(backend).attend(1, q, k, v, msa, md, MSA, SCALE)
    dq, dk, dv = tensors(n, 2 * DRAFT_KV_HEADS, DRAFT_KV_HEADS, DRAFT_KV_HEADS)
    with md.swap_kv_cache_manager(manager.draft_subpage_view):
        out["draft"] = backend.attention(DRAFT, dq, dk, dv, md, SCALE)
    return out


@pytest.mark.parametrize(
    "backend, bound",
    [
        (VanillaAttentionBackend(), None),
        (TritonAttentionBackend(), None),
        (TritonAttentionBackend(), 1024),  # launches sized by the table's width (CUDA graphs)
        (TritonAttentionBackend(draft_subpage_addressing=False), 1024),  # the view's own table
    ],
    ids=["vanilla", "triton", "triton-bound", "triton-expanded-table"],
)
def test_slot_zero_poison_never_reaches_an_output(backend, bound):
    manager = m3_manager(128, "float32")
    md = step_on(manager, STEPS, num_contexts=1)
    md.kv_len_bound = bound
    assert all(0 not in slots for slots in manager.get_batch_cache_indices(md.request_ids))
    assert (md.kv_cache_block_offsets[0, :, 0] == 0).any()  # padding entries name slot 0
    manager.pools[0][0].view(torch.float32).fill_(float("nan"))
    draft_pages, _ = manager.draft_subpage_view.get_kv_pages(DRAFT)
    assert draft_pages[: manager.draft_subpage_view.slot_units].isnan().any()  # poison in place
    for name, out in outputs(backend, manager, md).items():
        assert torch.isfinite(out).all(), name


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
def test_a_read_past_the_row_does_find_the_poison():
    # the control: attention told that every sequence runs 256 positions past its blocks
    manager = m3_manager(128, "float32")
    md = step_on(manager, STEPS, num_contexts=1)
    md.kv_len_bound = 1024
    manager.pools[0][0].view(torch.float32).fill_(float("nan"))
    md.num_cached_tokens += 256
    md.kv_lens += 256
    out = outputs(TritonAttentionBackend(), manager, md)
    assert not torch.isfinite(out["dense"]).all()
