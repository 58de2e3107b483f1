"""Handing the heap pages a layer's loading freed back to the operating system.

glibc keeps the pages of freed allocations in its heap for later ones, so the process's
resident memory does not fall when they are freed. Loading a compressed layer frees, on
the CPU, the temporaries of its processing: vLLM's stand-in rows of a bitmask layer, a
tensor-parallel rank's re-compressed columns, a plan's random weights, a decompressed
weight replaced by its packed form. ``release_freed_heap`` (``malloc_trim(0)``, which also
returns free pages inside the heap, glibc 2.8 on) gives them back after each layer, so
that the engine's resident memory saves what the weights save
(benchmarks/results/JOURNAL.md).

Imports only the standard library; elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["release_freed_heap"]


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_heap() -> bool:
    """Return the heap's free pages to the OS; whether any were (False where not glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
