"""Where an unstructured layer's rows lie in memory for the CPU op.

At one token the op's row kernels walk eight rows side by side and ask for the next eight's
lines as they go (``kernels/avx512_bf16.cpp``). Where a row's kept values take about a
multiple of 4 KiB (a 50 % bfloat16 row of 4096 inputs keeps 2048 values, 4 KiB), those
sixteen rows' current lines fall into the same few sets of the core's L1 cache, and stay
there as the rows advance (the likely cost; this machine has no counters to show it).
Leaving a few unused values after each row moves each row's lines ``SPREAD_BYTES`` on from
the last one's. Spread rows read faster in the machine's fast memory phases and alike in
its slow ones (benchmarks/results/JOURNAL.md). 4096 × 11008, whose rows are not near a
multiple of 4 KiB, is not spread. The
kernels read each row from its ``row_offsets`` entry by its popcounts, so what lies between
rows is never read as a value.

The checkpoint's layout stays the format's (``format.bitmask``, rows back to back). Only
the served layers ``cpu.served_layer`` builds (the vLLM plugin's) hold a spread
copy, and only where rows are near a multiple of 4 KiB: at most ``2 * SPREAD_BYTES`` more
a row (3 % of a 50 % row of 4096 inputs). transformers' loader keeps the checkpoint's
tensors as the module's parameters, which ``save_pretrained`` writes back as they are, so
its layers are not spread.

Imports only torch.
"""

from __future__ import annotations

import math

import torch

__all__ = ["PAGE_BYTES", "SPREAD_BYTES", "row_gap", "spread_for_op", "spread_rows"]

PAGE_BYTES = 4096
"""The stride at which lines fall into the same L1 sets (64 sets of 64-byte lines)."""

SPREAD_BYTES = 128
"""How far each row's start moves past the last one's, modulo ``PAGE_BYTES``, once spread;
also how near a multiple of ``PAGE_BYTES`` a row's mean size must be to be spread. 64
bytes gained less and 256 little more, at twice the memory (benchmarks/results/JOURNAL.md)."""


def row_gap(values: int, rows: int, itemsize: int) -> int:
    """How many unused values to leave after each of ``rows`` rows holding ``values`` kept
    values of ``itemsize`` bytes in all: 0 unless their mean size is within
    ``SPREAD_BYTES`` of a multiple of ``PAGE_BYTES`` (rows much shorter than that lie in
    different sets anyway); else enough to make it ``SPREAD_BYTES`` past one."""
    pitch = values * itemsize / max(1, rows)
    if pitch < PAGE_BYTES - SPREAD_BYTES:
        return 0
    past = pitch % PAGE_BYTES
    if min(past, PAGE_BYTES - past) >= SPREAD_BYTES:
        return 0
    return math.ceil(((SPREAD_BYTES - past) % PAGE_BYTES) / itemsize)


def spread_rows(
    values: torch.Tensor, row_offsets: torch.Tensor, gap: int, block_rows: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, row_offsets)`` of the same layer with ``gap`` zeros after every row (the
    last included): row ``n`` moves ``n * gap`` values on. ``values`` is 1-D, row after
    row from ``row_offsets`` (int64, rising); rows are copied ``block_rows`` at a time, so
    the index tensors stay small."""
    if gap == 0:
        return values, row_offsets
    rows = row_offsets.numel()
    ends = torch.cat([row_offsets[1:], row_offsets.new_tensor([values.numel()])])
    spread = values.new_zeros(values.numel() + gap * rows)
    for first in range(0, rows, block_rows):
        last = min(rows, first + block_rows)
        start, end = int(row_offsets[first]), int(ends[last - 1])
        counts = ends[first:last] - row_offsets[first:last]
        row_of_value = torch.repeat_interleave(torch.arange(first, last), counts)
        spread[torch.arange(start, end) + gap * row_of_value] = values[start:end]
    return spread, row_offsets + gap * torch.arange(rows, dtype=row_offsets.dtype)


def spread_for_op(
    values: torch.Tensor, row_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked layer's ``(values, row_offsets)`` as the op's modules hold them: spread by
    ``row_gap`` of its rows (unchanged where that is 0)."""
    gap = row_gap(values.numel(), row_offsets.numel(), values.element_size())
    return spread_rows(values, row_offsets, gap)
