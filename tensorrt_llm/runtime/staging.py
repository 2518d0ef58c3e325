"""PinnedStaging: pinned host memory for host-to-device copies, reused copy after copy.

A copy from pageable host memory is not asynchronous (the host waits while the driver stages it);
from pinned memory it is queued and the host goes on. A staging buffer must not be rewritten while
the copy that reads it may still be in flight, so each copy records an event and the next ``take``
waits for it (by then it has almost always completed).
"""

from __future__ import annotations

import torch


class PinnedStaging:
    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._last_copy: torch.cuda.Event | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        return self._buffer

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat pinned buffer of ``numel`` elements (contents undefined), once the last copy
        from it is done; reallocated only to grow."""
        if self._last_copy is not None:
            self._last_copy.synchronize()
            self._last_copy = None
        buf = self._buffer
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            grown = 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0
            buf = self._buffer = torch.empty(max(numel, grown), dtype=dtype, pin_memory=True)
        return buf[:numel]

    def copy_to(self, dst: torch.Tensor, staged: torch.Tensor) -> None:
        """Queue ``dst.copy_(staged)`` (``staged`` from ``take``) on the current stream."""
        dst.copy_(staged, non_blocking=True)
        self._last_copy = torch.cuda.Event()
        self._last_copy.record()

    def upload(self, dst: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``dst.copy_(values)`` (a host tensor): queued through this staging where ``dst`` is on
        CUDA, a plain copy elsewhere. Returns ``dst``."""
        if dst.device.type != "cuda":
            return dst.copy_(values)
        staged = self.take(values.numel(), dst.dtype).view(values.shape)
        self.copy_to(dst, staged.copy_(values))
        return dst


class DeviceReadback:
    """The host's view of a small device tensor, refreshed without waiting for the device: each
    ``refresh`` queues a copy into pinned memory and, once the copy before it has completed,
    takes its values (so on CUDA they may be a step behind; elsewhere they are current)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self.values: list = []

    def refresh(self, tensor: torch.Tensor) -> list:
        if tensor.device.type != "cuda":
            self.values = tensor.tolist()
            return self.values
        if self._copied is not None and self._copied.query():
            self.values, self._copied = self._host.tolist(), None
        if self._copied is None:
            if self._host is None or self._host.shape != tensor.shape:
                self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.values
