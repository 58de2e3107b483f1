"""The op's spread rows (``cpu.row_spread``): where a layer's rows are near a multiple of 4 KiB,
its values lie in memory with a gap after each row; every kernel reads them from their
offsets exactly as the format's back-to-back rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_cpu_kernels import BITMASK_PATHS, integer_sparse, isa  # noqa: F401 (isa: a fixture)
from whisper_sparse.cpu import op as kernels
from whisper_sparse.cpu.op import PathThresholds
from whisper_sparse.cpu.row_spread import (
    PAGE_BYTES,
    SPREAD_BYTES,
    row_gap,
    spread_rows,
)
from whisper_sparse.format.bitmask import compress_bitmask


@pytest.mark.parametrize(
    ("values", "rows", "itemsize", "gap"),
    [
        (2048 * 10, 10, 2, 64),  # a 50 % bfloat16 row of 4096 inputs: 4 KiB
        (2028 * 10, 10, 2, 84),  # 40 bytes short of 4 KiB
        (2111 * 10, 10, 2, 1),  # 126 bytes past 4 KiB
        (2112 * 10, 10, 2, 0),  # 128 bytes past: far enough
        (1024 * 10, 10, 4, 32),  # float32, 4 KiB
        (4096 * 10, 10, 2, 64),  # 8 KiB
        (1434 * 10, 10, 2, 0),  # 65 % of 4096 inputs: 2.8 KiB
        (5504 * 10, 10, 2, 0),  # 50 % of 11008 inputs
        (0, 10, 2, 0),  # rows that keep nothing
        (25 * 10, 10, 2, 0),  # rows of 50 bytes: far shorter than a page
        (2000 * 10, 10, 2, 112),  # 96 bytes short of 4 KiB
        (1948 * 10, 10, 2, 0),  # 200 bytes short: far enough
    ],
)
def test_row_gap_moves_rows_near_4kib_off(values, rows, itemsize, gap):
    assert row_gap(values, rows, itemsize) == gap
    if gap:  # then the mean row starts SPREAD_BYTES (to a value) past a multiple of 4 KiB
        past = (values * itemsize / rows + gap * itemsize) % PAGE_BYTES
        assert SPREAD_BYTES <= past < SPREAD_BYTES + itemsize


@pytest.mark.parametrize("gap", [0, 1, 5, 64])
def test_spread_rows_keeps_every_value_at_its_row(gap):
    """Rows that keep nothing, rows that keep everything, and a tail: each row's values at
    its new offset, zeros between rows, the same in blocks of 3 rows as in one."""
    generator = torch.Generator().manual_seed(1)
    weight = integer_sparse(11, 37, 0.5, torch.bfloat16, generator)
    weight[2] = 0
    weight[5] = torch.randint(1, 4, (37,), generator=generator).to(torch.bfloat16)
    values, bitmask, row_offsets = compress_bitmask(weight)
    spread, offsets = spread_rows(values, row_offsets, gap)
    assert spread.numel() == values.numel() + 11 * gap
    assert torch.equal(offsets, row_offsets + gap * torch.arange(11))
    kept = weight != 0
    for row in range(11):
        count = int(kept[row].sum())
        assert torch.equal(spread[offsets[row] : offsets[row] + count], weight[row][kept[row]])
        assert not spread[offsets[row] + count : offsets[row] + count + gap].any()
    blocked = spread_rows(values, row_offsets, gap, block_rows=3)
    assert torch.equal(blocked[0], spread) and torch.equal(blocked[1], offsets)


needs_kernels = pytest.mark.skipif(
    kernels.cpu_kernels_unavailable() is not None, reason="the CPU op does not run here"
)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", BITMASK_PATHS)
@pytest.mark.usefixtures("isa")  # every instruction set this CPU runs
def test_the_op_reads_spread_rows_exactly(dtype, path):
    """On every instruction set and path, a spread layer's outputs are the unspread one's,
    bit for bit (integer values: both the float64 reference rounded once), and its
    decompression is the weight."""
    generator = torch.Generator().manual_seed(2)
    thresholds = PathThresholds.only(path)
    for rows, columns, gap in ((7, 37, 5), (33, 100, 64), (17, 4100, 3), (9, 2049, 1)):
        for sparsity in (0.0, 0.5, 0.65, 1.0):
            weight = integer_sparse(rows, columns, sparsity, dtype, generator)
            values, bitmask, row_offsets = compress_bitmask(weight)
            spread, offsets = spread_rows(values, row_offsets, gap)
            assert torch.equal(
                kernels.bitmask_decompress_cpu(spread, bitmask, offsets, columns), weight
            )
            for tokens in (1, 2, 5, 17, 70):
                x = torch.randint(-3, 4, (tokens, columns), generator=generator).to(dtype)
                plain = kernels.bitmask_cpu_linear(
                    x, values, bitmask, row_offsets, None, columns, thresholds
                )
                got = kernels.bitmask_cpu_linear(
                    x, spread, bitmask, offsets, None, columns, thresholds
                )
                assert torch.equal(got, plain), (rows, columns, sparsity, tokens)


@needs_kernels
def test_the_served_module_spreads_rows_near_4kib():
    """A served layer in rows (``served_layer``, not grouped) spreads a 50 % bfloat16 layer
    of 4096 inputs (and not a 65 % one), keeps its density, and gives F.linear of the weight
    exactly."""
    from whisper_sparse.cpu.linear import CpuSparseLinear
    from whisper_sparse.cpu.served_layer import served_layer

    generator = torch.Generator().manual_seed(3)
    for sparsity, gap in ((0.5, True), (0.65, False)):
        weight = torch.zeros(16, 4096, dtype=torch.bfloat16)
        for row in range(16):  # exactly (1 - sparsity) of each row kept
            kept = torch.randperm(4096, generator=generator)[: round((1 - sparsity) * 4096)]
            weight[row, kept] = torch.randint(1, 4, (kept.numel(),), generator=generator).to(
                torch.bfloat16
            )
        values, bitmask, row_offsets = compress_bitmask(weight)
        layer = served_layer(values, bitmask, 4096, row_offsets, "layer", grouped=False)
        module = CpuSparseLinear.serving(layer)
        expected_gap = row_gap(values.numel(), 16, 2)
        assert (expected_gap > 0) == gap
        assert torch.equal(module.row_offsets, row_offsets + expected_gap * torch.arange(16))
        assert module.density() == pytest.approx(values.numel() / (16 * 4096))
        x = torch.randint(-3, 4, (3, 4096), generator=generator).to(torch.bfloat16)
        assert torch.equal(module(x), F.linear(x.double(), weight.double()).to(torch.bfloat16))
