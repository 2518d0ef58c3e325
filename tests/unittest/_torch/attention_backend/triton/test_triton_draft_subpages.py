"""The Eagle3 draft layer through the unified cache's sub-pages: the in-kernel sub-page addressing
(from the target's slot table) and the view's expanded table both equal the torch reference, on a
real ``MiniMaxM3KVCacheManagerV2`` and its ``draft_subpage_view``, for the write and the
attention."""

import pytest
import torch

pytest.importorskip("triton.language")

from m3_cache import DRAFT, DRAFT_KV_HEADS, HEAD_DIM, m3_manager, step_on  # noqa: E402
from paged_case import DEVICE  # noqa: E402

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton.addressing import draft_subpage_kv  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton.backend import (  # noqa: E402
    TritonAttentionBackend,
)
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttentionBackend  # noqa: E402

# a fresh 150-token prompt, a 10-token chunk after 290 cached, decodes of 1 + 3 at 130 and 255
STEPS = [(0, 150), (290, 10), (130, 4), (255, 4)]
NUM_HEADS = 2 * DRAFT_KV_HEADS  # GQA 2
SCALE = HEAD_DIM**-0.5


def draft_inputs(md, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = md.num_tokens
    q, k, v = (torch.randn(n, h, HEAD_DIM, generator=g) for h in (NUM_HEADS, 4, 4))
    return [x.half().to(DEVICE) for x in (q, k, v)]


def run(manager, md, backend, attach):
    """The draft layer's step from the same starting pool: (output, pool after the write)."""
    q, k, v = draft_inputs(md)
    start = manager.pools[0].clone()
    view = manager.draft_subpage_view
    if attach == "swap":  # the first draft step: the view swapped in over the target's table
        with md.swap_kv_cache_manager(view):
            out = backend.attention(DRAFT, q, k, v, md, SCALE)
    else:  # a chained draft step: metadata built on the view itself (its expanded table)
        view_md = AttentionMetadata(
            view, md.request_ids, md.seq_lens, md.num_cached_tokens_per_seq, md.num_contexts,
            device=DEVICE,
        )  # fmt: skip
        out = backend.attention(DRAFT, q, k, v, view_md, SCALE)
    after = manager.pools[0].clone()
    manager.pools[0].copy_(start)
    return out, after


@pytest.mark.parametrize(
    "subpage_tokens, dtype", [(32, "float16"), (64, "float16"), (128, "float16"), (32, "fp8")]
)
def test_in_kernel_and_expanded_table_addressing_equal_the_reference(
    monkeypatch, subpage_tokens, dtype
):
    """FP8: the rows and their scales written bit for bit as the reference writes them."""
    monkeypatch.setenv("TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK", str(subpage_tokens))
    manager = m3_manager(dtype=dtype)
    view = manager.draft_subpage_view
    assert view.tokens_per_block == subpage_tokens and view.subdiv == 128 // subpage_tokens
    md = step_on(manager, STEPS, num_contexts=2)
    expected, expected_pool = run(manager, md, VanillaAttentionBackend(), "swap")
    in_kernel = TritonAttentionBackend()
    with md.swap_kv_cache_manager(view):  # the in-kernel path is the one taken under the swap
        addressing = in_kernel.paged_kv(md, DRAFT).addressing
    assert (addressing.block_tokens, addressing.page_tokens) == (128, subpage_tokens)
    assert (addressing.page_units, addressing.v_page_offset) == (view.slot_units, view.subdiv)
    for backend, attach in (
        (in_kernel, "swap"),
        (TritonAttentionBackend(draft_subpage_addressing=False), "swap"),
        (in_kernel, "view"),
    ):
        out, pool = run(manager, md, backend, attach)
        assert torch.equal(pool, expected_pool), (backend.draft_subpage_addressing, attach)
        torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


def test_the_swap_exposes_the_target_table_only_while_it_lasts():
    manager = m3_manager()
    md = step_on(manager, STEPS[:1], num_contexts=1)
    slot_table = md.kv_cache_block_offsets
    assert md.swapped_out is None
    with md.swap_kv_cache_manager(manager.draft_subpage_view):
        assert md.swapped_out[0] is manager and md.swapped_out[1] is slot_table
    assert md.swapped_out is None and md.kv_cache_block_offsets is slot_table


def test_a_slot_table_of_another_manager_is_refused():
    manager, other = m3_manager(), m3_manager()
    md = step_on(other, STEPS[:1], num_contexts=1)
    with pytest.raises(ValueError, match="does not own the slots of this draft view"):
        draft_subpage_kv(manager.draft_subpage_view, DRAFT, other, md.kv_cache_block_offsets)
