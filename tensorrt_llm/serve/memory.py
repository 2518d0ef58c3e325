"""Memory a large request took comes back: glibc keeps what a process frees in its heaps (decoded
images, a long prompt's buffers), so after one the resident size stays up for good. A server
watches its resident size and, when it has grown past the level it last settled at, asks glibc to
give the free pages back (``malloc_trim``), off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os

from tensorrt_llm.logger import logger

CHECK_EVERY_S = 2.0
TRIM_ABOVE_BYTES = 32 * 2**20  # growth over the settled level that is worth a trim


def resident_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class MemoryReturn:
    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self.settled = resident_bytes()
        self.num_trims = 0
        self.num_bytes_returned = 0

    def release(self) -> int:
        """Give free heap pages back to the system now; returns the resident bytes that went."""
        before = resident_bytes()
        if self._trim is not None:
            self._trim(0)
            self.num_trims += 1
        self.settled = resident_bytes()
        returned = max(0, before - self.settled)
        self.num_bytes_returned += returned
        return returned

    async def watch(self) -> None:
        """Every ``CHECK_EVERY_S``: a trim when the resident size grew past the settled level."""
        if self._trim is None:
            logger.info("no malloc_trim in this C library: freed memory stays with the server")
            return
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            if resident_bytes() - self.settled > TRIM_ABOVE_BYTES:
                returned = await asyncio.to_thread(self.release)
                logger.debug("returned %d MiB of freed memory", returned >> 20)
            else:  # settle lower too, when memory went back by itself
                self.settled = min(self.settled, resident_bytes())

    @contextlib.asynccontextmanager
    async def watching(self):
        task = asyncio.ensure_future(self.watch())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
