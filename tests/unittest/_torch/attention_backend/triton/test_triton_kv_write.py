"""The Triton KV write against a plain torch scatter: exact bytes, nothing else touched."""

import pytest
import torch

pytest.importorskip("triton.language")

from paged_case import MIXED_CACHED, MIXED_Q, make_case  # noqa: E402

from tensorrt_llm._torch.attention_backend.triton.ops import write_kv_pages  # noqa: E402


def torch_write(case, k, v):
    """The oracle: ``pages[table[s, lane, p // page_tokens], p % page_tokens] = x[t]``, per lane."""
    k_pages, v_pages = case.kv.k_pages.clone(), case.kv.v_pages.clone()
    page_tokens = k_pages.shape[1]
    pos, seq = case.position_ids, case.token_seq_idx
    for lane, pages, x in ((0, k_pages, k), (1, v_pages, v)):
        page = case.kv.block_table[seq, lane, pos // page_tokens].long()
        pages[page, pos % page_tokens] = x.to(pages.dtype)
    return k_pages, v_pages


def assert_same_bytes(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("page_tokens", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batch_of_17_lands_where_the_torch_scatter_puts_it(page_tokens, dtype):
    case = make_case(MIXED_Q, MIXED_CACHED, page_tokens, num_kv_heads=4, head_dim=24, dtype=dtype)
    k, v = case.step_kv()
    expected = torch_write(case, k, v)
    write_kv_pages(k, v, case.kv, case.position_ids, case.token_seq_idx)
    assert_same_bytes(case.kv.k_pages, expected[0])
    assert_same_bytes(case.kv.v_pages, expected[1])


def test_values_are_cast_to_the_page_dtype_and_strided_inputs_are_read_by_stride():
    case = make_case([3, 40], [5, 0], 32, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    k, v = (x.float() for x in case.step_kv())
    k_strided = torch.stack([k, -k], dim=-1).flatten(-2)[..., ::2]  # head_dim stride 2
    expected = torch_write(case, k, v)
    write_kv_pages(k_strided, v, case.kv, case.position_ids, case.token_seq_idx)
    assert_same_bytes(case.kv.k_pages, expected[0])
    assert_same_bytes(case.kv.v_pages, expected[1])


def test_a_step_without_tokens_writes_nothing():
    case = make_case([2], [0], 32)
    before = case.kv.k_pages.clone()
    empty = case.q.new_empty((0, 2, 16))
    no_tokens = case.position_ids[:0]
    write_kv_pages(empty, empty, case.kv, no_tokens, no_tokens)
    assert_same_bytes(case.kv.k_pages, before)
