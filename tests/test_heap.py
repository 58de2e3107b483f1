"""``whisper_sparse.heap``: the pages of freed heap allocations go back to the OS."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from whisper_sparse.heap import _malloc_trim, release_freed_heap

BLOCK = 64 * 1024  # below glibc's mmap threshold (128 KiB): served from the heap
BLOCKS = 4096  # 256 MiB


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_freed_heap_pages_stay_resident_until_released():
    """256 MiB of small blocks, written and freed under one block still held (so the heap's
    top cannot shrink by itself): resident until ``release_freed_heap``, then given back."""
    if _malloc_trim() is None:
        pytest.skip("not glibc: release_freed_heap does nothing here")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)
    held = libc.malloc(BLOCK)  # above the freed blocks
    for block in blocks:
        libc.free(block)
    freed = resident_bytes()
    try:
        assert release_freed_heap()
        released = resident_bytes()
    finally:
        libc.free(held)
    assert freed - released > BLOCKS * BLOCK // 2, (freed, released)
