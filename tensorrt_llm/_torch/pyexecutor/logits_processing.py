"""OpenAI's presence and frequency penalties and logit bias, and the token constraints
(``allowed_token_ids``, bad words), applied on the device to the target's logits of a step,
before sampling and before speculative acceptance: the same tensor operations eagerly and inside
a CUDA graph, with no loop over the requests and no host sync.

A request with any of them holds a slot of ``LogitsState`` while it runs: its output tokens'
counts ``[V]`` (kept on the device: each step adds the tokens it made, ``record``) and its bias
``[V]`` (``logit_bias``, and ``-inf`` at every token it may not write: outside
``allowed_token_ids``, or a bad word of one token). Row ``r`` of a step's logits is adjusted by
``bias - frequency * count - presence * (count > 0)`` of its request's slot (``adjust``); rows of
requests without them point at the scratch slot and get zeros. Bad words of several tokens are
matched against each row's preceding tokens (``bad_words.py``).

A generation request's rows are its verify positions: row ``j`` predicts the token after its
output and its first ``j`` drafts, so the penalties of row ``j`` count those drafts as output
(the tokens that precede the position if they are accepted). That keeps speculative decoding
lossless under the penalties: each emitted token is chosen from the logits plain decoding would
have used. Those counts are the step's ``pairs``: (row, draft token, how often the token occurs
among the drafts ahead of the row), one pair per row and distinct token carrying the count (the
others carry 0), added on top of the slot's counts. Every addition is a ``scatter_add_`` that
meets at most one nonzero value per entry, so the sums do not depend on the order of the adds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from tensorrt_llm._torch.pyexecutor.bad_words import BadWordState
from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager

PENALTY_BLOCK = 2048  # vocabulary entries per program of ``_penalty_kernel``

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm._torch.pyexecutor.seq_slot_manager import SeqSlotManager


@dataclass
class PenaltyRows:
    """A step's logits rows as ``adjust`` sees them (device tensors; ``R`` rows, ``P`` pairs)."""

    slots: torch.Tensor  # [R] each row's LogitsState slot
    presence: torch.Tensor  # [R] fp32
    frequency: torch.Tensor  # [R] fp32
    pair_rows: torch.Tensor  # [P] the row a draft precedes
    pair_tokens: torch.Tensor  # [P] the draft
    # [P] its occurrences among the drafts ahead of the row, at its first one (0 elsewhere)
    pair_counts: torch.Tensor
    group_slots: torch.Tensor  # [n] each group of ``T`` rows' slot (a request's verify rows)
    drafts: torch.Tensor  # [n, K] each group's drafts


class LogitsState(BaseResourceManager):
    """The penalties' counts and the bias of each request that has them, a row per request slot
    (``SeqSlotManager``; allocated at the first such request, or for the CUDA graphs that read
    them at start-up) and the scratch row that the others point at: the executor's
    ``LOGITS_STATE``, 8 bytes per vocabulary entry and row, and the rows' bad words
    (``BadWordState``)."""

    def __init__(self, seq_slots: SeqSlotManager, vocab_size: int, device: torch.device) -> None:
        self.seq_slots = seq_slots
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None  # [slots + 1, V] int32
        self.bias: torch.Tensor | None = None  # [slots + 1, V] fp32
        self.bad_words: BadWordState | None = None
        self._filled: set[int] = set()  # requests whose row holds their counts and bias

    @property
    def scratch(self) -> int:
        return self.seq_slots.scratch

    @property
    def allocated(self) -> bool:
        return self.counts is not None

    def get_max_resource_count(self) -> int:
        return self.seq_slots.capacity

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        return 0  # (its row is its request slot's)

    def slots(self, requests: Sequence[LlmRequest]) -> list[int]:
        """Each request's slot, its row filled at its first step (from its output so far, its
        bias and constraints); the scratch slot for a request without any of them."""
        out = []
        for req in requests:
            if not req.sampling_params.processes_logits:
                out.append(self.scratch)
                continue
            slot = self.seq_slots.slot(req)
            if req.request_id not in self._filled:
                self._fill(req, slot)
            out.append(slot)
        return out

    def allocate(self) -> None:
        """The counts and bias, now (CUDA graphs that read them are captured at start-up)."""
        if self.counts is None:
            shape = (self.seq_slots.capacity + 1, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.bias = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.bad_words = BadWordState(shape[0], self.device)

    def _fill(self, req: LlmRequest, slot: int) -> None:
        self.allocate()
        self._filled.add(req.request_id)
        output = torch.tensor(req.output_token_ids, dtype=torch.long)
        self.counts[slot] = torch.bincount(output, minlength=self.vocab_size)[: self.vocab_size].to(
            self.device, torch.int32
        )
        params = req.sampling_params
        bias = torch.zeros(self.vocab_size)
        if params.allowed_token_ids is not None:
            bias.fill_(float("-inf"))
            bias[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = 0.0
        for token, value in (params.logit_bias or {}).items():
            if token < self.vocab_size and bias[token] == 0.0:
                bias[token] = value
        singles = [word[0] for word in req.bad_word_ids if len(word) == 1]
        bias[torch.tensor(singles, dtype=torch.long)] = float("-inf")
        self.bias[slot] = bias.to(self.device)
        self.bad_words.fill(slot, req.bad_word_ids, req.output_token_ids)

    def free_resources(self, request: LlmRequest) -> None:
        self._filled.discard(request.request_id)

    @torch.inference_mode()  # the logits are inference tensors
    def adjust(self, logits: torch.Tensor, rows: PenaltyRows, kernel: bool | None = None) -> None:
        """``logits [R, V]`` in place: each row's bias and penalties. On CUDA (``kernel``) one
        Triton program per row and block of the vocabulary, which reads nothing for rows at the
        scratch slot (a batch whose rows mostly have no penalties pays for those that do)."""
        if kernel if kernel is not None else logits.is_cuda:
            num_rows, vocab = logits.shape
            grid = (num_rows, triton.cdiv(vocab, PENALTY_BLOCK))
            _penalty_kernel[grid](
                logits, logits.stride(0), self.counts, self.bias, rows.slots, rows.presence,
                rows.frequency, vocab, self.scratch, BLOCK=PENALTY_BLOCK,
            )  # fmt: skip
        else:
            counts = self.counts[rows.slots]  # [R, V]
            penalty = rows.frequency[:, None] * counts + rows.presence[:, None] * (counts > 0)
            logits += (self.bias[rows.slots] - penalty).to(logits.dtype)
        # the drafts ahead of a verify row count as its output, and add presence where the
        # token had no count yet
        vocab = logits.shape[1]
        had = self.counts[rows.slots[rows.pair_rows], rows.pair_tokens]
        new = (rows.pair_counts > 0) & (had == 0)
        row_frequency, row_presence = rows.frequency[rows.pair_rows], rows.presence[rows.pair_rows]
        delta = -(row_frequency * rows.pair_counts + row_presence * new)
        flat = rows.pair_rows * vocab + rows.pair_tokens
        logits.view(-1).scatter_add_(0, flat, delta.to(logits.dtype))
        self.bad_words.ban(logits, rows.group_slots, rows.drafts)

    @torch.inference_mode()  # the logits are inference tensors
    def record(self, slots: torch.Tensor, tokens: torch.Tensor, num_new: torch.Tensor) -> None:
        """Count each row's first ``num_new [n]`` of ``tokens [n, T]`` into its slot (the scratch
        slot's counts are never read with a nonzero penalty)."""
        width = tokens.shape[1]
        made = torch.arange(width, device=tokens.device)[None, :] < num_new[:, None]
        flat = (slots[:, None] * self.vocab_size + tokens).flatten()
        self.counts.view(-1).scatter_add_(0, flat, made.flatten().to(torch.int32))
        self.bad_words.record(slots, tokens, num_new)


def draft_pairs(drafts: torch.Tensor, num_drafts: torch.Tensor, first_row: torch.Tensor):
    """For ``n`` verify groups of ``T = K + 1`` rows (``drafts [n, K]``, ``num_drafts [n]``,
    ``first_row [n]``: each group's first logits row): every (row, draft before it) pair, flat
    ``[n * K * (K + 1) / 2]``: rows, tokens and counts, as ``PenaltyRows`` takes them."""
    k = drafts.shape[1]
    j, d = torch.tril_indices(k + 1, k, offset=-1, device=drafts.device)  # draft d precedes row j
    has = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]  # [n, K]
    same = (drafts[:, :, None] == drafts[:, None, :]) & has[:, None, :] & has[:, :, None]
    earlier = torch.tril(torch.ones(k, k, dtype=torch.bool, device=drafts.device), diagonal=-1)
    first = has & ~(same & earlier).any(dim=2)  # [n, K]: no equal draft before it
    ahead = same.to(torch.float32).cumsum(dim=2)  # [n, K, K]: [.., d, c] occurrences in 0..c
    counts = ahead[:, d, j - 1] * first[:, d]  # (j >= 1 for every pair)
    return (first_row[:, None] + j[None, :]).flatten(), drafts[:, d].flatten(), counts.flatten()


@triton.jit
def _penalty_kernel(
    logits_ptr, logits_stride, counts_ptr, bias_ptr, slots_ptr, presence_ptr, frequency_ptr,
    vocab, scratch, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)``, vocabulary block ``program_id(1)``: ``logits += bias - frequency *
    count - presence * (count > 0)`` of the row's slot, rounded as the torch form rounds (the
    change in fp32, then to the logits' dtype, then added); nothing read at the scratch slot."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < vocab) & (offs * 0 + slot != scratch)  # (a block: the interpreter wants one)
    count = tl.load(counts_ptr + slot * vocab + offs, mask=mask, other=0)
    bias = tl.load(bias_ptr + slot * vocab + offs, mask=mask, other=0.0)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    penalty = frequency * count.to(tl.float32) + presence * (count > 0).to(tl.float32)
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=mask)
    change = (bias - penalty).to(x.dtype).to(tl.float32)  # (torch adds in fp32, then rounds)
    tl.store(
        logits_ptr + row * logits_stride + offs, (x.to(tl.float32) + change).to(x.dtype), mask=mask
    )
