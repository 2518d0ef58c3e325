"""Top-p sampling by rejection against a rising pivot (``nucleus.py``): the Triton program (under
the interpreter on the CPU) draws the torch form's tokens, and the tokens follow the top-p
distribution a sort defines (``sampler.filtered_probs``)."""

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.nucleus import nucleus_kernel_sample, nucleus_torch
from tensorrt_llm._torch.pyexecutor.sampler import SamplingTensors, filtered_probs, sample


def batch(n: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 3
    temperature = torch.rand(n, generator=gen) + 0.3
    temperature[::7] = 0.0  # greedy rows
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.05
    top_p[::5] = 1.0
    top_p[3] = 1e-4  # the first token alone: rejections until the pivot reaches the top
    u = torch.rand(n, 32, generator=gen)
    return logits, temperature, top_p, u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_program_draws_the_torch_forms_tokens(dtype):
    pytest.importorskip("triton.language")
    if torch.cuda.is_available():
        pytest.skip("the interpreter's CPU form (the GPU runs it in test_llm_triton_gpu.py)")
    logits, temperature, top_p, u = batch(48, 2500)  # two blocks and a partial one per row
    logits = logits.to(dtype)
    want = nucleus_torch(logits, temperature, top_p, u)
    got = nucleus_kernel_sample(logits, temperature, top_p, u)
    assert got.tolist() == want.tolist()
    greedy = temperature == 0
    assert (got[greedy] == logits[greedy].float().argmax(dim=-1)).all()
    assert got[3] == logits[3].float().argmax()


def test_the_rounds_end_at_a_kept_token():
    logits, temperature, top_p, u = batch(200, 300, seed=1)
    tokens = nucleus_torch(logits, temperature, top_p, u)
    kept = filtered_probs(logits, rows(temperature, top_p)) > 0
    assert kept.gather(1, tokens[:, None]).all()


def rows(temperature: torch.Tensor, top_p: torch.Tensor) -> SamplingTensors:
    n = temperature.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    return SamplingTensors(temperature, zeros, top_p, zeros, zeros, False, uses_top_k=False)


@pytest.mark.parametrize("top_p", [1.0, 0.8, 0.3])
def test_tokens_follow_the_top_p_distribution(top_p):
    n = 20000  # seeds: 3 sigma of a frequency is at most 0.011
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]]).expand(n, -1)
    st = SamplingTensors(
        torch.full((n,), 0.8),
        torch.zeros(n, dtype=torch.long),
        torch.full((n,), top_p),
        torch.arange(n, dtype=torch.long) * 7919 + 1,
        torch.zeros(n, dtype=torch.long),
        all_greedy=False,
        uses_top_k=False,
    )
    frequency = torch.bincount(sample(logits, st), minlength=8) / n
    torch.testing.assert_close(frequency, filtered_probs(logits[:1], st.select(slice(0, 1)))[0],
                               atol=0.011, rtol=0)  # fmt: skip
