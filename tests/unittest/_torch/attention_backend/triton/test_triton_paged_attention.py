"""The Triton paged-attention op against ``causal_attention`` on dense K/V, on awkward batches."""

import pytest
import torch

pytest.importorskip("triton.language")

from paged_case import MIXED_CACHED, MIXED_Q, make_case  # noqa: E402

from tensorrt_llm._torch.attention_backend.triton.addressing import (  # noqa: E402
    PageAddressing,
    PagedKV,
)
from tensorrt_llm._torch.attention_backend.triton.ops import (  # noqa: E402
    DECODE_PROGRAMS_PER_SM,
    choose_num_splits,
    decode_num_splits,
    paged_attention,
    write_kv_pages,
)

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def attend(case, scale=0.3, num_splits=None):
    k, v = case.step_kv()
    write_kv_pages(k, v, case.kv, case.position_ids, case.token_seq_idx)
    return paged_attention(case.q, case.kv, case.batch, scale, num_splits)


def assert_matches_reference(out, case, scale=0.3):
    tol = TOLERANCE[case.q.dtype]
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), case.reference(scale).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "page_tokens, group, dtype",
    [
        (32, 1, torch.bfloat16),
        (32, 4, torch.float32),
        (64, 4, torch.bfloat16),
        (64, 1, torch.float32),
        (128, 4, torch.float32),
        (128, 1, torch.bfloat16),
    ],
)
def test_a_mixed_batch_of_17_matches_the_reference(page_tokens, group, dtype):
    case = make_case(MIXED_Q, MIXED_CACHED, page_tokens, group=group, head_dim=24, dtype=dtype)
    assert_matches_reference(attend(case), case)


@pytest.mark.parametrize(
    "num_splits, group, page_tokens, dtype",
    [(1, 1, 64, torch.float32), (4, 4, 128, torch.bfloat16)],
)
def test_past_1000_tokens_prefill_chunked_prefill_and_decode(num_splits, group, page_tokens, dtype):
    # a fresh 1030-token prompt, a 64-token chunk after 1000 cached, a 1 + 3 decode at 1100
    steps = ([1030, 64, 4], [0, 1000, 1100])
    case = make_case(*steps, page_tokens, num_kv_heads=1, group=group, head_dim=16, dtype=dtype)
    assert_matches_reference(attend(case, num_splits=num_splits), case)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16])
def test_decode_is_the_same_for_any_split_count(num_splits):
    """1 + 3 query tokens per sequence, GQA 4; 16 splits leave most splits of a sequence empty."""
    case = make_case([4] * 5, [1, 100, 300, 600, 47], 32, group=4, head_dim=16, seed=1)
    assert_matches_reference(attend(case, num_splits=num_splits), case)


def test_the_split_count_follows_the_shape():
    # a launch that fills the device (or the CPU's single "multiprocessor") runs unsplit
    assert choose_num_splits(num_programs=264, max_kv_len=100_000, num_sms=132) == 1
    assert choose_num_splits(num_programs=5, max_kv_len=100_000, num_sms=1) == 1
    # a small batch at long context: about eight programs per multiprocessor, at most 64 splits
    assert choose_num_splits(num_programs=8, max_kv_len=100_000, num_sms=132) == 64
    assert choose_num_splits(num_programs=64, max_kv_len=100_000, num_sms=132) == 17
    # ... but never a split of fewer than 256 keys
    assert choose_num_splits(num_programs=8, max_kv_len=1000, num_sms=132) == 4
    assert choose_num_splits(num_programs=8, max_kv_len=200, num_sms=132) == 1
    # dense decode asks for about two programs per multiprocessor, a power of two of splits
    assert choose_num_splits(32, 32768, 132, programs_per_sm=DECODE_PROGRAMS_PER_SM) == 9
    assert decode_num_splits(32, 32768, 132) == 8  # 8 x 32K, 4 KV heads
    assert decode_num_splits(64, 32768, 132) == 4 and decode_num_splits(300, 32768, 132) == 1


def test_bad_arguments_are_errors_naming_the_value():
    case = make_case([4, 2], [3, 0], 32, group=2)
    with pytest.raises(ValueError, match="num_splits=0"):
        paged_attention(case.q, case.kv, case.batch, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="num_heads=3"):
        paged_attention(case.q[:, :3], case.kv, case.batch, 1.0)
    with pytest.raises(ValueError, match=r"q \(6, 16\) torch.float32 must be"):
        paged_attention(case.q[:, 0], case.kv, case.batch, 1.0)
    k, v = case.step_kv()
    with pytest.raises(ValueError, match=r"position_ids has shape \(5,\)"):
        write_kv_pages(k, v, case.kv, case.position_ids[:5], case.token_seq_idx)
    with pytest.raises(ValueError, match="addressing.page_tokens=64"):
        PagedKV(case.kv.k_pages, case.kv.v_pages, case.kv.block_table, PageAddressing.plain(64))
    with pytest.raises(ValueError, match="block_tokens=48 is not a multiple of page_tokens=32"):
        PageAddressing(48, 32)
