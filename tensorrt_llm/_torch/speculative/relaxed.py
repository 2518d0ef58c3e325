"""Relaxed acceptance in the thinking phase (``MTPDecodingConfig.use_relaxed_acceptance_for_thinking``).

Inside a reasoning block (after ``<mm:think>``, before ``</mm:think>``) a greedy row accepts a
draft that is not the target's argmax when it is among the target's ``topk`` most likely tokens
and its probability is at least the top token's minus ``delta``; outside it, and for the markers
themselves, acceptance stays exact. The answer after the reasoning is then the target's own greedy
continuation of what was accepted; the reasoning may differ from target-only decoding (it is a
speed-for-fidelity trade the user asks for). ``topk=1, delta=0`` accepts exactly as greedy does.
Sampled rows keep rejection sampling.

Whether a row is in the thinking phase is device state per request slot (``ThinkingPhases``),
read and advanced by index tensors inside the step, so it works eagerly, inside CUDA graphs and
under the overlap scheduler (where the host has not seen the last step's tokens). The host sets
a slot's phase once, when its request first has a row, from the tokens it knows then: the prompt
(a local prefill) or the prompt and the first token (a transferred generation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tensorrt_llm._torch.speculative.interface import RelaxedAcceptance

THINKING_MARKERS = ("<mm:think>", "</mm:think>")


def with_markers(relaxed: RelaxedAcceptance, tokenizer) -> RelaxedAcceptance:
    """``relaxed`` with the marker ids it leaves unset taken from ``tokenizer`` (each marker must
    be one token of it)."""
    found = {}
    for field, text in zip(("begin", "end"), THINKING_MARKERS):
        if getattr(relaxed, field) is not None:
            continue
        ids = None if tokenizer is None else tokenizer.encode(text)
        one = ids is not None and len(ids) == 1
        if not one or tokenizer.decode(ids, skip_special_tokens=False) != text:
            raise ValueError(
                "use_relaxed_acceptance_for_thinking: the tokenizer "
                + ("is not loaded" if ids is None else f"has no single token {text!r}")
                + f"; give speculative_config.{field}_thinking_phase_token"
            )
        found[field] = ids[0]
    return dataclasses.replace(relaxed, **found)


def thinking_after(tokens: Sequence[int], begin: int, end: int) -> bool:
    """Whether ``tokens`` end inside a reasoning block (the last marker among them is ``begin``)."""
    for token in reversed(tokens):
        if token == begin:
            return True
        if token == end:
            return False
    return False


class ThinkingPhases:
    """Each request slot's phase after its last token (``[slots + 1]`` bool; the last row is the
    scratch slot of padding rows)."""

    def __init__(self, relaxed: RelaxedAcceptance, num_slots: int, device: torch.device) -> None:
        self.relaxed = relaxed
        self.phase = torch.zeros(num_slots + 1, dtype=torch.bool, device=device)

    def start(self, slots: list[int], token_lists: list[Sequence[int]]) -> None:
        """The phases of requests seen for the first time, from the tokens the host has."""
        r = self.relaxed
        values = torch.tensor([thinking_after(t, r.begin, r.end) for t in token_lists])
        index = torch.tensor(slots)
        self.phase[index.to(self.phase.device, non_blocking=True)] = values.to(self.phase.device)

    def accept(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        valid: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy acceptance, relaxed in the thinking phase: ``logits [n, K + 1, V]``, ``drafts
        [n, K]`` (``valid``: the ones a row has), ``slots [n]`` -> ``tokens [n, K + 1]`` (the
        accepted drafts, then the target's argmax) and ``accepted [n]``."""
        r, k = self.relaxed, drafts.shape[1]
        argmax = logits.argmax(dim=-1)
        probs = torch.softmax(logits[:, :k].float(), dim=-1)
        top_p, top_ids = probs.topk(min(r.topk, probs.shape[-1]), dim=-1)
        close = (top_p >= top_p[..., :1] - r.delta) & (top_p > 0)  # (never a masked-out token)
        in_top = ((top_ids == drafts[..., None]) & close).any(dim=-1)
        marker = (drafts == r.begin) | (drafts == r.end)
        # the phase before each draft: the slot's, then as each earlier draft leaves it
        phase = self.phase[slots]
        before = []
        for j in range(k):
            before.append(phase)
            phase = self._after(phase, drafts[:, j])
        relaxed = torch.stack(before, dim=1) & ~marker
        ok = torch.where(relaxed, in_top, drafts == argmax[:, :k]) & valid
        accepted = ok.int().cumprod(dim=1).sum(dim=1)
        tokens = torch.cat([drafts, argmax[:, k:]], dim=1)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        tokens[rows, accepted] = argmax[rows, accepted]
        return tokens, accepted

    def advance(self, slots: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """Each slot's phase after the row's new tokens (``tokens [n, T]``, the first
        ``accepted + 1``). Padding rows all write the scratch slot."""
        phase = self.phase[slots]
        for j in range(tokens.shape[1]):
            phase = torch.where(j <= accepted, self._after(phase, tokens[:, j]), phase)
        self.phase.index_copy_(0, slots, phase)

    def _after(self, phase: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return (phase | (token == self.relaxed.begin)) & (token != self.relaxed.end)
