"""FP8 block scales: the format's (de)quantization, and the Triton GEMM against its torch reference
and against the dequantized matmul within the format's error bound; awkward sizes (not multiples
of 128). Under Triton's interpreter on a CPU, compiled on a GPU."""

import pytest
import torch

from tensorrt_llm._torch.modules.fp8.block import (
    FP8,
    dequantize_weight,
    quantize_activation,
    quantize_weight,
    reference_linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The reference sums in fp32. So does the interpreter; Hopper's FP8 tensor cores keep about 14 bits
# of each 128-channel step's sum (as DeepSeek-V3 reports), hence the GPU's looser bound.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5} if DEVICE == "cpu" else {"rtol": 2e-3, "atol": 5e-3}


def test_weights_round_trip_within_half_a_step_per_block():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.linspace(0.01, 10, 300)  # blocks of any scale
    q, scale_inv = quantize_weight(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale_inv.shape == (2, 3)
    back = dequantize_weight(q, scale_inv)
    # e4m3 has 3 mantissa bits: a value is off by at most 2^-4 of its magnitude (normal range)
    assert ((back - w).abs() <= w.abs() / 16 + scale_inv.max() * 2**-9).all()
    assert torch.equal(dequantize_weight(*quantize_weight(back)), back)  # already on the grid


def test_a_scale_of_the_wrong_shape_is_refused():
    q, scale_inv = quantize_weight(torch.randn(130, 64))
    with pytest.raises(
        ValueError,
        match=r"weight_scale_inv \(1, 1\) does not fit a weight \(130, 64\): expected \(2, 1\)",
    ):
        dequantize_weight(q, scale_inv[:1])


def test_activation_groups_are_scaled_to_448():
    x = torch.randn(3, 200)
    q, scale = quantize_activation(x)
    assert scale.shape == (3, 2)
    assert (
        q[:, :128].float().abs().amax(1).eq(448).all()
        and q[:, 128:].float().abs().amax(1).eq(448).all()
    )


triton = pytest.importorskip("triton.language")
from tensorrt_llm._torch.modules.fp8.ops import GemmTiles, fp8_block_linear  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(1, 200, 300), (17, 96, 130), (40, 256, 256), (0, 64, 64)])
def test_the_gemm_matches_its_reference(m, n, k, dtype):
    g = torch.Generator().manual_seed(m + n + k)
    w, scale_inv = quantize_weight(torch.randn(n, k, generator=g) / k**0.5)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    want = reference_linear(x, w, scale_inv)
    got = fp8_block_linear(x.to(DEVICE), w.to(DEVICE), scale_inv.to(DEVICE)).cpu()
    assert got.shape == (m, n) and got.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    # and the dequantized matmul, within the activations' quantization error (2^-4 relative per
    # element, random signs: ~ 2^-4 * |x| |w| sqrt(k) / sqrt(3))
    exact = x.float() @ dequantize_weight(w, scale_inv).T
    bound = 2**-4 * (x.float().abs() @ dequantize_weight(w, scale_inv).abs().T) + 1e-2
    assert ((got.float() - exact).abs() <= bound).all()


@pytest.mark.parametrize(
    "tiles",
    [
        GemmTiles(16, 128, splits=1, steps_per_split=5),  # one program sums every step
        GemmTiles(16, 64, splits=2, steps_per_split=3),  # the last split is short
        GemmTiles(32, 32, splits=5, steps_per_split=1),  # a split per step
    ],
)
def test_split_k_sums_every_step_once(tiles):
    g = torch.Generator().manual_seed(1)
    w, scale_inv = quantize_weight(torch.randn(200, 600, generator=g) / 600**0.5)  # 5 K steps
    x = torch.randn(20, 600, generator=g)
    want = reference_linear(x, w, scale_inv)
    got = fp8_block_linear(x.to(DEVICE), w.to(DEVICE), scale_inv.to(DEVICE), tiles).cpu()
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_a_weight_that_is_not_fp8_is_refused():
    with pytest.raises(ValueError, match="expected weight \\[out, in\\] float8_e4m3fn"):
        fp8_block_linear(torch.randn(2, 64), torch.randn(64, 64), torch.ones(1, 1))
