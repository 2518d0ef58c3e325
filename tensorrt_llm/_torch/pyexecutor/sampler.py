"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed."""

from __future__ import annotations

import torch

from tensorrt_llm.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [..., V]`` -> the probabilities ``params`` samples from (temperature, top-k, top-p)."""
    logits = logits.float() / max(params.temperature or 1.0, 1e-6)
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class TorchSampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """``logits [n, V]`` with one ``SamplingParams`` per row -> tokens ``[n]`` (on the CPU).

        Greedy rows take the argmax in one op; sampled rows draw from their filtered distribution
        with the request's generator (seeded requests are reproducible).
        """
        tokens = logits.argmax(dim=-1).cpu()
        for row, (p, gen) in enumerate(zip(params, generators)):
            if not p.greedy:
                probs = filtered_probs(logits[row], p).cpu()
                tokens[row] = torch.multinomial(probs, 1, generator=gen).item()
        return tokens


def token_logprobs(
    rows: torch.Tensor, tokens: list[int], top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per token, its log-probability under its row of logits and the ``top`` most likely (tokens,
    log-probabilities): one softmax and one copy to the host for the request's step."""
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist()
    values, ids = torch.topk(logprobs, top, dim=-1)
    return [
        (lp, list(zip(i, v, strict=True)))
        for lp, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)
    ]
