"""DraftGuide: the grammars' masks of a step's draft chain, so that the drafter proposes only what
the grammar allows (``GuidedDecoder.drafting``).

Unmasked, a drafter proposes what the target would write without the grammar, and the target,
masked, refuses most of it. Masked by the same grammar at each depth, its proposal is its best
guess under the constraint, which the masked target accepts as often as it would unconstrained.
Verification is unchanged, so the output is the same either way; only the acceptance moves.

Each mask depends on the tokens before it, which are on the device: the worker's chain calls
``begin`` with the step's tokens and counts (the host waits for them), ``mask`` before each draft
(with the draft before it, read the same way), then ``end``. The matchers take the step's new
tokens and the drafts for the masks and give them all back at the end: the next step's ``fill``
takes the emitted tokens as usual. A row without a grammar, or whose grammar has ended, is not
masked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tensorrt_llm.runtime.staging import PinnedStaging


class DraftGuide:
    def __init__(
        self,
        matchers: list,
        fill_rows: Callable[[list, torch.Tensor, list[int]], None],
        words: int,
        device: torch.device,
        staging: PinnedStaging,
    ) -> None:
        """``matchers``: each row's grammar matcher (xgrammar's; None: the row has none);
        ``fill_rows(matchers, mask, rows)`` fills their rows of a mask (``GrammarCompiler``'s)."""
        self._matchers = list(matchers)
        self._fill_rows = fill_rows
        self._words = words
        self._device = device
        self._staging = staging
        self._live: list[int] = []  # rows whose matcher goes on
        # the tokens each row's matcher took here, given back at the end
        self._taken = [0] * len(self._matchers)

    def begin(self, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """The step's new tokens (``tokens [n, T]``, the first ``accepted + 1`` of each row) into
        the rows' matchers (the host waits for them). Rows past the guides' are padding."""
        self._matchers += [None] * (tokens.shape[0] - len(self._matchers))
        self._taken += [0] * (tokens.shape[0] - len(self._taken))
        rows = [i for i, matcher in enumerate(self._matchers) if matcher is not None]
        if not rows:
            return
        at = torch.tensor(rows, device=tokens.device)
        new = tokens[at].tolist()
        counts = (accepted[at] + 1).tolist()
        for i, row_tokens, count in zip(rows, new, counts, strict=True):
            if all(self._take(i, token) for token in row_tokens[:count]):
                self._live.append(i)

    def mask(self, drafted: torch.Tensor | None) -> torch.Tensor | None:
        """``[n, words]`` int32 on the device: what each row's next draft may be, after
        ``drafted [n]`` (the draft before it; None for the first). None when no row is masked."""
        if drafted is not None and self._live:
            at = torch.tensor(self._live, device=drafted.device)
            taken = drafted[at].tolist()
            self._live = [i for i, t in zip(self._live, taken, strict=True) if self._take(i, t)]
        if not self._live:
            return None
        host = torch.full((len(self._matchers), self._words), -1, dtype=torch.int32)
        matchers = [self._matchers[i] for i in self._live]
        self._fill_rows(matchers, host, list(self._live))
        out = torch.empty(host.shape, dtype=torch.int32, device=self._device)
        return self._staging.upload(out, host)

    def end(self) -> None:
        """Every matcher given back the tokens it took here."""
        for matcher, n in zip(self._matchers, self._taken, strict=True):
            if n:
                matcher.rollback(n)
        self._taken = [0] * len(self._matchers)
        self._live = []

    def _take(self, row: int, token: int) -> bool:
        """Whether row ``row``'s matcher took ``token`` and goes on (not ended)."""
        matcher = self._matchers[row]
        if matcher.is_terminated() or not matcher.accept_token(token):
            return False
        self._taken[row] += 1
        return not matcher.is_terminated()
