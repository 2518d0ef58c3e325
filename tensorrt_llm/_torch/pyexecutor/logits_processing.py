"""OpenAI's presence and frequency penalties and logit bias, applied in place to the target's
logits of a step, before sampling and before speculative acceptance.

A generation request's rows are its verify positions: row ``j`` predicts the token after its
output and its first ``j`` drafts, so the penalties of row ``j`` count those drafts as output (the
tokens that precede the position if they are accepted). That keeps speculative decoding lossless
under the penalties: each emitted token is chosen from the logits plain decoding would have used.
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState


@torch.inference_mode()  # the logits are inference tensors
def process_logits(requests: list[LlmRequest], logits: torch.Tensor, num_logits: list[int]) -> None:
    """Apply each request's ``SamplingParams`` penalties and bias to its rows of ``logits``."""
    row = 0
    for req, n in zip(requests, num_logits, strict=True):
        if n and req.sampling_params.processes_logits:
            _process_rows(req, logits[row : row + n])
        row += n


def _process_rows(req: LlmRequest, rows: torch.Tensor) -> None:
    params, (n, vocab) = req.sampling_params, rows.shape
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab]
        bias = torch.tensor([params.logit_bias[t] for t in ids], dtype=rows.dtype)
        rows[:, torch.tensor(ids, dtype=torch.long, device=rows.device)] += bias.to(rows.device)
    if not (params.presence_penalty or params.frequency_penalty):
        return
    # counts[j]: the output, plus the drafts before verify row j (the first row has none)
    drafts = req.py_draft_tokens if req.state is LlmRequestState.GENERATION_IN_PROGRESS else []
    steps = torch.zeros(n, vocab, dtype=torch.long)
    for j, token in enumerate(drafts[: n - 1]):
        steps[j + 1, token] = 1
    output = torch.tensor(req.output_token_ids, dtype=torch.long)
    counts = torch.bincount(output, minlength=vocab)[:vocab] + steps.cumsum(dim=0)
    counts = counts.to(device=rows.device, dtype=rows.dtype)
    rows -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
        rows.dtype
    )
