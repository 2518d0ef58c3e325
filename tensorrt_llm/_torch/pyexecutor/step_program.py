"""The one program of a step, on device tensors only, in two parts: ``forward_step``, then
``finish_step``. Eager steps call them on the ``StepInputs`` their batch was built into; the CUDA
graph runner captures each on a bucket's, as two graphs. Between them the host may fill the
grammars' masks from the tokens of the step before (the overlap scheduler's guided requests).

forward -> logits of each row's positions -> penalties and bias -> the grammars' mask -> the tokens
(sampled, or the speculative worker's accept and draft chain) -> the penalties' counts -> logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState, PenaltyRows, draft_pairs
from tensorrt_llm._torch.pyexecutor.nucleus import row_logprobs
from tensorrt_llm._torch.pyexecutor.sampler import sample
from tensorrt_llm._torch.pyexecutor.step_inputs import StepInputs
from tensorrt_llm._torch.pyexecutor.token_bitmask import apply_token_bitmask

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
    from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker
    from tensorrt_llm._torch.speculative.interface import DraftGuide

Logprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class StepOutputs:
    """A step's results on the device, ``n`` rows of ``T`` positions: the logits, the tokens
    (row ``i``'s new ones are the first ``num_accepted[i] + 1``; without speculation one), the
    next drafts, and each token's logprob with the ``top`` most likely ``(values, ids)``."""

    logits: torch.Tensor  # [n * T, V]
    tokens: torch.Tensor  # [n, T]
    num_accepted: torch.Tensor | None = None  # [n]
    drafts: torch.Tensor | None = None  # [n, K]
    logprobs: Logprobs | None = None  # [n, T], [n, T, top], [n, T, top]

    def first(self, n: int) -> StepOutputs:
        """The first ``n`` rows (views)."""
        width = self.tokens.shape[1]

        def head(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:n]

        logprobs = None if self.logprobs is None else tuple(t[:n] for t in self.logprobs)
        return StepOutputs(
            self.logits[: n * width],
            self.tokens[:n],
            head(self.num_accepted),
            head(self.drafts),
            logprobs,
        )


@dataclass
class Forwarded:
    """A step's first part on the device: the logits of its rows (penalties and bias applied)
    and the target's hidden states the drafter reads."""

    logits: torch.Tensor  # [n * T, V]
    captured: list[torch.Tensor]


def forward_step(
    engine: PyTorchModelEngine,
    inputs: StepInputs,
    md: AttentionMetadata,
    *,
    logits_state: LogitsState | None = None,
    logits_out: torch.Tensor | None = None,
    **forward_extra,
) -> Forwarded:
    """The step's first part: the forward, each row's logits (into ``logits_out`` when given: a
    graph's, the buffer every bucket shares), penalties and bias. Nothing in it reads the
    grammars' masks, so the host may fill them meanwhile. ``md`` is the step's metadata (a
    bucket's is placed here from its first positions)."""
    if inputs.first_positions is not None:
        md.place(inputs.first_positions, inputs.cu_seqlens_q)
    hidden, captured = engine.model(
        inputs.input_ids, attn_metadata=md, capture_layers=engine.capture_layers, **forward_extra
    )
    if inputs.token_index is not None:
        hidden = hidden[inputs.token_index.flatten()]
    logits = engine.model.compute_logits(hidden, logits_out)  # [n * T, V]
    if inputs.penalties is not None:
        logits_state.adjust(logits, step_penalty_rows(inputs))
    return Forwarded(logits, captured)


def finish_step(
    forwarded: Forwarded,
    inputs: StepInputs,
    md: AttentionMetadata,
    *,
    logits_state: LogitsState | None = None,
    spec_worker: Eagle3OneModelWorker | None = None,
    chain_md: AttentionMetadata | None = None,
    draft_guide: DraftGuide | None = None,
) -> StepOutputs:
    """The step's second part: the grammars' mask, the tokens (sampled, or the speculative
    worker's accept and draft chain; ``chain_md`` the chain's metadata where it is preallocated,
    a bucket's; ``draft_guide`` the grammars' masks of the drafts, which the host reads, so
    never captured), the penalties' counts, logprobs."""
    logits = forwarded.logits
    if inputs.bitmask is not None:  # (after the penalties: a refused token stays refused)
        apply_token_bitmask(logits, inputs.bitmask)
    if spec_worker is None:
        tokens = logits.argmax(dim=-1) if inputs.st is None else sample(logits, inputs.st)
        tokens, accepted, drafts = tokens[:, None], None, None
    else:
        captured = forwarded.captured
        tokens, accepted, drafts = spec_worker.step(
            inputs, logits, captured, md, chain_md, draft_guide
        )
    if inputs.penalties is not None:  # the tokens just made count from the next step on
        made = torch.ones_like(tokens[:, 0]) if accepted is None else accepted + 1
        logits_state.record(inputs.penalties.slots, tokens, made)
    logprobs = None
    if inputs.top_logprobs is not None:
        logprobs = token_logprobs(logits, tokens, inputs.top_logprobs)
    return StepOutputs(logits, tokens, accepted, drafts, logprobs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> Logprobs | None:
    """Each token's logprob ``[n, T]`` and the ``top`` most likely (values, ids) ``[n, T, top]``
    from ``logits [n * T, V]``. Log-softmax keeps the order: the top logits and the chosen ones
    are read in their own dtype, then moved by each row's log-sum-exp."""
    n, width = tokens.shape
    if n == 0:  # no row made a token (a prompt's chunk that does not finish it)
        return None
    lse, values, ids = row_logprobs(logits, top)
    chosen = logits.view(n, width, -1).gather(-1, tokens[..., None])[..., 0].float()
    lse = lse.view(n, width)
    return (
        chosen - lse,
        (values - lse.view(-1, 1)).view(n, width, top),
        ids.view(n, width, top),
    )


def step_penalty_rows(inputs: StepInputs) -> PenaltyRows:
    """A step's ``n * T`` logits rows as ``adjust`` sees them: each row's slot and penalties
    repeated over its ``T`` positions, the pairs of its drafts (``draft_pairs``), and each
    group's slot and drafts (its bad words)."""
    n, width, penalties = inputs.num_rows, inputs.width, inputs.penalties
    first_row = torch.arange(n, device=inputs.drafts.device) * width
    return PenaltyRows(
        penalties.slots.repeat_interleave(width),
        penalties.presence.repeat_interleave(width),
        penalties.frequency.repeat_interleave(width),
        *draft_pairs(inputs.drafts, inputs.num_drafts, first_row),
        penalties.slots,
        inputs.drafts,
    )
