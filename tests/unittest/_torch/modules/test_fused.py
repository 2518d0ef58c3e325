"""The one-launch Triton forms of RMSNorm and partial RoPE against the torch forms (the reference),
on awkward sizes; under Triton's interpreter on a CPU."""

import pytest
import torch

from tensorrt_llm._torch.modules import fused
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.modules.rotary_embedding import apply_partial_rope

pytest.importorskip("triton.language")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tolerance(dtype: torch.dtype) -> dict:
    """fp32: the reduction order's rounding; bf16: a rounding flip of the same fp32 value."""
    return {"rtol": 1e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 20), (17, 3, 128), (5, 2048), (0, 64)])
def test_rms_norm_matches_the_torch_form(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1], generator=g) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    with torch.no_grad():
        want = norm(x)  # the torch form, on the CPU
        got = fused.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,num_heads,head_dim,rotary_dim",
    [(1, 1, 8, 8), (17, 3, 20, 8), (97, 16, 128, 64), (5, 4, 128, 128)],
)
def test_partial_rope_matches_the_torch_form(num_tokens, num_heads, head_dim, rotary_dim, dtype):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 5000, (num_tokens,), generator=g).to(DEVICE)
    with torch.enable_grad():  # the torch form on the same device (the fused one has no backward)
        want = apply_partial_rope(x.clone().requires_grad_(), positions, rotary_dim, 10000.0)
    got = fused.partial_rope(x, positions, rotary_dim, 10000.0)
    assert got.shape == x.shape and got.dtype == dtype
    # the rest of each head is copied bit for bit; the rotated part agrees to fp32 rounding
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
    torch.testing.assert_close(got.float(), want.detach().float(), **tolerance(dtype))


def test_partial_rope_rejects_bad_shapes():
    x = torch.zeros(4, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rotary_dim"):
        fused.partial_rope(x, torch.zeros(4, dtype=torch.long, device=DEVICE), 7, 10000.0)
    with pytest.raises(ValueError, match="positions"):
        fused.partial_rope(x, torch.zeros(3, dtype=torch.long, device=DEVICE), 8, 10000.0)


def test_the_layers_use_the_torch_form_where_the_fused_one_does_not_apply():
    x = torch.ones(2, 4, requires_grad=True)
    assert not fused.use_fused(x)  # a CPU tensor
    if torch.cuda.is_available():
        y = torch.ones(2, 4, device="cuda", requires_grad=True)
        assert not fused.use_fused(y)  # autograd: the torch form, which has a backward
        with torch.no_grad():
            assert fused.use_fused(y)
