"""An unstructured layer's kept values laid out as one stream per group of rows, for the CPU
op's bfloat16 kernels.

In the checkpoint's layout (``format.bitmask``) each row's kept values lie back to back. At
one token the op's row kernels read eight rows side by side, each row a stream of its own,
and ask for the next eight rows' lines as they go: about 32 streams per thread. In the
grouped layout the rows are taken ``GROUP_ROWS`` at a time, and a group's kept values are
stored step by step: for each ``STEP_INPUTS`` inputs, the kept values of the group's first
row there, then its second row's, and so on. A group is then read as one stream, front to
back, whatever its sparsity. The masks are stored apart, ``[groups, steps, GROUP_ROWS]``
32-bit words (the bits of a row's ``STEP_INPUTS`` inputs, lowest first; rows past the
layer's last are all zeros), so that no value's address waits on a value's load, and
``group_offsets[g]`` is where group ``g``'s values start (``groups + 1`` entries, the last
the values' end). ``PAD_VALUES`` zeros follow the last value, so that a kernel may load
``STEP_INPUTS`` values from anywhere in the layer.

A probe of this layout read faster than the row kernels before it was built
(benchmarks/results/JOURNAL.md).

Only the vLLM plugin's served layers hold it (``served_layer.GroupedLayer``), on
``avx512_bf16`` kernels with bfloat16 weights; ``group_layout`` builds it from a checked
layer (the op's ``grouped_decompress`` gives the dense weight back), ``group_for_op`` as
those layers hold it: its values and masks in huge pages (``cpu.huge_pages``).

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import torch

from whisper_sparse.cpu.huge_pages import in_huge_pages

__all__ = ["GROUP_ROWS", "PAD_VALUES", "STEP_INPUTS", "group_for_op", "group_layout"]

GROUP_ROWS = 8
"""Rows per group: the rows the one-token kernel reads side by side (kGroupRows)."""
STEP_INPUTS = 32
"""Inputs per step: one vpexpandw's mask."""
PAD_VALUES = 32
"""Zeros after the last value: one step's load of 32 values never leaves the tensor."""


def _step_masks(bitmask: torch.Tensor, steps: int) -> torch.Tensor:
    """``[rows, steps]`` int32: each row's bits of ``STEP_INPUTS`` inputs per step (the
    bitmask's bytes, lowest first, zero-padded to whole steps)."""
    padded = bitmask.new_zeros(bitmask.shape[0], steps * 4)
    padded[:, : bitmask.shape[1]] = bitmask
    return padded.view(torch.int32)


def _step_counts(bitmask: torch.Tensor, steps: int) -> torch.Tensor:
    """``[rows, steps]`` int64: how many values each row keeps in each step."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    per_byte = bits.sum(-1, dtype=torch.int64)
    padded = per_byte.new_zeros(bitmask.shape[0], steps * 4)
    padded[:, : bitmask.shape[1]] = per_byte
    return padded.view(bitmask.shape[0], steps, 4).sum(-1)


def _exclusive_cumsum(counts: torch.Tensor, dim: int) -> torch.Tensor:
    return counts.cumsum(dim) - counts


def group_layout(
    values: torch.Tensor,
    bitmask: torch.Tensor,
    row_offsets: torch.Tensor,
    in_features: int,
    block_groups: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, group_masks, group_offsets)`` of a checked unstructured layer (each row's
    values from its ``row_offsets`` entry on, as many as its mask bits) in the grouped
    layout; ``block_groups`` groups are placed at a time, so the index tensors stay small."""
    rows = bitmask.shape[0]
    steps = -(-in_features // STEP_INPUTS)
    groups = -(-rows // GROUP_ROWS)
    masks = torch.zeros(groups * GROUP_ROWS, steps, dtype=torch.int32)
    masks[:rows] = _step_masks(bitmask, steps)
    counts = torch.zeros(groups * GROUP_ROWS, steps, dtype=torch.int64)
    counts[:rows] = _step_counts(bitmask, steps)
    # per group, the (step, row) segments in stream order, and where each starts
    stream = counts.view(groups, GROUP_ROWS, steps).transpose(1, 2).reshape(groups, -1)
    group_sizes = stream.sum(1)
    group_offsets = torch.zeros(groups + 1, dtype=torch.int64)
    group_offsets[1:] = group_sizes.cumsum(0)
    starts = group_offsets[:-1, None] + _exclusive_cumsum(stream, 1)
    starts = starts.view(groups, steps, GROUP_ROWS).transpose(1, 2).reshape(-1, steps)
    grouped = values.new_zeros(int(group_offsets[-1]) + PAD_VALUES)
    sources = row_offsets.to(torch.int64)[:, None] + _exclusive_cumsum(counts[:rows], 1)
    for first in range(0, rows, block_groups * GROUP_ROWS):
        last = min(rows, first + block_groups * GROUP_ROWS)
        lengths = counts[first:last].flatten()
        shift = (starts[first:last] - sources[first:last]).flatten()
        begin = int(sources[first, 0])
        source = torch.arange(begin, begin + int(lengths.sum()))
        grouped[source + torch.repeat_interleave(shift, lengths)] = values[source]
    group_masks = masks.view(groups, GROUP_ROWS, steps).transpose(1, 2).contiguous()
    return grouped, group_masks, group_offsets


def group_for_op(
    values: torch.Tensor, bitmask: torch.Tensor, row_offsets: torch.Tensor, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``group_layout`` of a checked layer as the op's modules hold it: its values and masks
    in huge pages where the kernel offers them (``cpu.huge_pages``: the grouped row kernels
    read them faster there, at one to four tokens, on a Zen 5 EPYC)."""
    grouped, group_masks, group_offsets = group_layout(values, bitmask, row_offsets, in_features)
    return in_huge_pages(grouped), in_huge_pages(group_masks), group_offsets
