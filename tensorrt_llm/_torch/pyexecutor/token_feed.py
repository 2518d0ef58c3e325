"""TokenFeed: the inputs a launched step's tokens give the next step, on the device (the overlap
scheduler, ``launched_step.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenFeed:
    """What the requests of a launched step that go on take as their next input, on the device.

    ``rows`` maps a request id to its row; row ``r`` continues with ``ids[r]`` (its last new token,
    then its next drafts) at ``advance[r]`` positions past where it stood (the tokens it added).
    ``max_advance`` bounds ``advance``: the KV a later step reserves covers it."""

    rows: dict[int, int]
    ids: torch.Tensor  # [n, 1 + num_drafts] long
    advance: torch.Tensor  # [n] long
    max_advance: int

    def take(self, request_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` and ``advance`` of these requests' rows, in this order."""
        rows = on_device([self.rows[r] for r in request_ids], self.ids.device)
        return self.ids[rows], self.advance[rows]


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small index tensor on ``device``, without waiting for the work queued there (a blocking
    copy would wait for the launched step)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
