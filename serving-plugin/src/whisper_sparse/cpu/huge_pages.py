"""A held tensor in transparent huge pages, where the kernel offers them.

The grouped row kernels (``kernels/avx512_bf16_grouped.cpp``) read a layer as one stream
of values and one of masks per thread, asking for their lines ahead in software. Those
streams read markedly faster from 2 MiB pages, where dense, the op's other layouts and its
GEMM did not gain beyond the noise (benchmarks/results/JOURNAL.md).

``in_huge_pages`` copies a tensor into an anonymous mapping aligned to 2 MiB whose whole
huge pages are advised ``MADV_HUGEPAGE`` before they are touched, so that the first touch
gives huge pages where the kernel's transparent huge pages are ``always`` or ``madvise``.
The part past the last whole huge page stays in small pages, so the resident bytes are the
tensor's. Elsewhere (not Linux, transparent huge pages ``never``, a tensor under 2 MiB, not
on the CPU) it returns the tensor itself.

Imports only torch and the standard library.
"""

from __future__ import annotations

import functools
import mmap
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE_BYTES", "huge_pages_offered", "in_huge_pages"]

HUGE_PAGE_BYTES = 2 * 1024 * 1024
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def huge_pages_offered() -> bool:
    """Whether this kernel gives transparent huge pages to a region advised for them: its
    setting is ``always`` or ``madvise`` (the bracketed word), and Python has the advice."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` whose whole 2 MiB pages are huge pages where the
    kernel offers them (``huge_pages_offered``), else ``tensor`` itself; the copy keeps
    its mapping alive."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < HUGE_PAGE_BYTES or not huge_pages_offered():
        return tensor
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError:  # a kernel built without transparent huge pages
        return tensor
    held = whole[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
    return held.copy_(tensor)
