"""Memory a large request took goes back to the system (issue 37, item 8): glibc keeps freed heap
pages, and the server's watcher has it return them once the resident size has grown."""

import asyncio

import pytest

from tensorrt_llm.serve import memory
from tensorrt_llm.serve.memory import MemoryReturn, resident_bytes

pytestmark = pytest.mark.skipif(memory._malloc_trim() is None, reason="needs glibc malloc_trim")


def fragment_heap() -> list:
    """~190 MiB of 64 KiB heap blocks (under glibc's mmap threshold), every hundredth kept: the
    freed pages sit below live blocks, where glibc does not give them back by itself."""
    blocks = [bytearray(b"x" * (64 * 1024)) for _ in range(3000)]
    return blocks[::100]


def test_release_gives_freed_heap_pages_back():
    returns = MemoryReturn()
    returns.release()  # from a trimmed heap: the blocks below take new pages, not freed ones
    before = resident_bytes()
    kept = fragment_heap()
    assert resident_bytes() - before > 150 * 2**20  # freed, but still resident
    assert returns.release() > 150 * 2**20
    assert resident_bytes() - before < 32 * 2**20 and len(kept) == 30


def test_the_watcher_returns_memory_once_the_resident_size_has_grown(monkeypatch):
    monkeypatch.setattr(memory, "CHECK_EVERY_S", 0.05)
    MemoryReturn().release()  # (as above)
    returns = MemoryReturn()

    async def scenario():
        async with returns.watching():
            kept = fragment_heap()
            for _ in range(100):
                await asyncio.sleep(0.05)
                if returns.num_trims:
                    break
            return kept

    before = resident_bytes()
    asyncio.run(scenario())
    assert returns.num_trims >= 1 and returns.num_bytes_returned > 150 * 2**20
    assert resident_bytes() - before < 32 * 2**20
