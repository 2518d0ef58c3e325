"""The FP8 KV row quantizer (``kv_quant.py``): a row's largest element keeps its value, nothing
saturates, a row of zeros stays zeros, and the error is e4m3's rounding."""

import torch

from tensorrt_llm._torch.attention_backend.kv_quant import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    dequantize_rows,
    quantize_rows,
)


def test_rows_keep_their_largest_element_and_round_within_e4m3s_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=g) * torch.logspace(-6, 6, 64)[:, None, None]
    x[3, 1] = 0.0
    rows, scales = quantize_rows(x)
    assert rows.dtype == FP8_DTYPE and scales.dtype == torch.float32
    assert scales.shape == x.shape[:-1]
    assert torch.isfinite(rows.float()).all()
    back = dequantize_rows(rows, scales)
    amax = x.abs().amax(-1)
    assert torch.allclose(back.abs().amax(-1), amax, rtol=1e-6, atol=0)
    assert (rows.float().abs().amax(-1)[amax > 0] == FP8_MAX).all()
    assert (back[3, 1] == 0).all() and scales[3, 1] == MIN_SCALE
    # e4m3 keeps 3 mantissa bits: a normal element is off by at most half its step, 1/16
    normal = x.abs() >= 2.0**-6 * scales[..., None]
    err = (back - x).abs()[normal] / x.abs()[normal]
    assert err.max() <= 1 / 16 + 1e-6
