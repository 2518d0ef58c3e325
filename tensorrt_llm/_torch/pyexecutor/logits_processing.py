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
        params = req.sampling_params
        if n and params.processes_logits:
            drafts = (
                req.py_draft_tokens if req.state is LlmRequestState.GENERATION_IN_PROGRESS else []
            )
            history = list(req.output_token_ids)
            for j in range(n):
                _process_row(logits[row + j], history, params)
                if j < len(drafts):
                    history.append(drafts[j])
        row += n


def _process_row(row: torch.Tensor, history: list[int], params) -> None:
    vocab = row.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t in params.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([params.logit_bias[t] for t in ids.tolist()], dtype=row.dtype)
        row.index_add_(0, ids.to(row.device), bias.to(row.device))
    if history and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(history, dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(device=row.device, dtype=row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            row.dtype
        )
