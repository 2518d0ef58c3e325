"""Bad words of more than one token (``SamplingParams.bad``, vLLM's ``bad_words``), banned on the
device: a word's last token is ``-inf`` at a logits row whose preceding output ends with the
word's other tokens. The same tensor operations eagerly and inside a CUDA graph, no loop over the
requests and no host sync. (A single-token word needs no history: it is ``-inf`` in its
request's bias row, ``LogitsState``.)

Per request slot (``SeqSlotManager``; rows of requests without such words, and a graph bucket's
padding rows, point at the scratch slot, which holds none)::

    words  [slots + 1, W, L]  int32  a word right-aligned (its last token in column L - 1), ANY
                                     before it; an unused word: ANY then -1 (bans nothing)
    recent [slots + 1, L - 1] int32  the output's last L - 1 tokens, -1 before its first

A step's rows come in groups of ``T = K + 1`` (a request's verify positions; see
``step_inputs``). Row ``j`` of a group predicts the token after the output and the group's first
``j`` drafts, so the tokens before it are::

    before(j) = (recent ++ drafts)[j : j + L - 1]                 [L - 1]
    word w is banned at row j  <=>  words[w, :L - 1] == before(j) wherever it is not ANY

which keeps speculative decoding lossless: a verify row refuses what plain decoding would have
refused after the same tokens. ``record`` moves each slot's ``recent`` on by the tokens its row
made (``num_new``: the accepted drafts and the token after them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorrt_llm.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS

ANY = -2  # a word's column before its first token: matches every token, and the -1 of ``recent``
MAX_WORDS = 2 * MAX_BAD_WORDS  # each word as written and after a space


class BadWordState:
    """The multi-token bad words and recent output of each slot (see the module's note)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        """``num_slots``: the slots with the scratch slot (its last)."""
        shape = (num_slots, MAX_WORDS, MAX_BAD_WORD_TOKENS)
        self.words = torch.full(shape, ANY, dtype=torch.int32, device=device)
        self.words[..., -1] = -1
        self.recent = torch.full(
            (num_slots, MAX_BAD_WORD_TOKENS - 1), -1, dtype=torch.int32, device=device
        )

    def fill(self, slot: int, words: Sequence[Sequence[int]], output: Sequence[int]) -> None:
        """Slot ``slot`` for a request with ``words`` (its words of one token are left out) and
        ``output`` so far."""
        table = torch.full(self.words.shape[1:], ANY, dtype=torch.int32)
        table[:, -1] = -1
        for i, word in enumerate(w for w in words if len(w) > 1):
            table[i, -len(word) :] = torch.tensor(word, dtype=torch.int32)
        span = self.recent.shape[1]
        recent = ([-1] * span + list(output))[-span:]
        self.words[slot] = table.to(self.words.device)
        self.recent[slot] = torch.tensor(recent, dtype=torch.int32).to(self.recent.device)

    def ban(self, logits: torch.Tensor, slots: torch.Tensor, drafts: torch.Tensor) -> None:
        """``logits [n * T, V]`` in place: ``-inf`` at each word's last token on the rows whose
        preceding tokens end with the rest of it, for ``n`` groups of slot ``slots [n]`` and
        drafts ``drafts [n, K]``."""
        n, k = drafts.shape
        width, span, vocab = k + 1, self.recent.shape[1], logits.shape[1]
        device = logits.device
        history = torch.cat([self.recent[slots], drafts.to(torch.int32)], dim=1)  # [n, span + K]
        at = torch.arange(width, device=device)[:, None] + torch.arange(span, device=device)
        before = history[:, at]  # [n, T, span]
        words = self.words[slots]  # [n, W, L]
        prefix = words[:, None, :, :span]  # [n, 1, W, span]
        last = words[:, None, :, span]  # [n, 1, W]
        hit = ((prefix == before[:, :, None, :]) | (prefix == ANY)).all(dim=-1) & (last >= 0)
        rows = torch.arange(n * width, device=device).view(n, width, 1)
        flat = rows * vocab + last.clamp(min=0)  # [n, T, W]
        banned = torch.where(hit, float("-inf"), 0.0).to(logits.dtype)
        logits.view(-1).scatter_add_(0, flat.flatten(), banned.flatten())

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, num_new: torch.Tensor) -> None:
        """Each row's first ``num_new [n]`` of ``tokens [n, T]`` onto its slot's ``recent`` (the
        scratch slot's may take any row's: it holds no word)."""
        span = self.recent.shape[1]
        history = torch.cat([self.recent[slots], tokens.to(torch.int32)], dim=1)  # [n, span + T]
        at = num_new[:, None] + torch.arange(span, device=tokens.device)  # the last span made
        self.recent.index_copy_(0, slots, history.gather(1, at))
