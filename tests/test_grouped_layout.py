"""The grouped layout of unstructured layers (``cpu.grouped_layout``): its build against a
slow re-implementation of its definition, the op over it on every path and
instruction set this CPU runs (bit for bit on integer values), and the vLLM plugin's module
that holds it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_cpu_kernels import BITMASK_PATHS, integer_sparse, isa  # noqa: F401 (a fixture)
from whisper_sparse.cpu import op as kernels
from whisper_sparse.cpu.grouped_layout import (
    GROUP_ROWS,
    PAD_VALUES,
    STEP_INPUTS,
    group_layout,
)
from whisper_sparse.cpu.op import PathThresholds
from whisper_sparse.format.bitmask import compress_bitmask

SHAPES = [(1, 1), (5, 12), (7, 37), (8, 32), (16, 64), (33, 100), (17, 4100), (9, 2049), (70, 1058)]

needs_kernels = pytest.mark.skipif(
    kernels.cpu_kernels_unavailable() is not None, reason="the CPU op does not run here"
)


def slow_group_layout(weight: torch.Tensor):
    """The layout's definition, value by value: per group of GROUP_ROWS rows, per step of
    STEP_INPUTS inputs, each row's kept values in order; its masks; its groups' starts."""
    rows, columns = weight.shape
    groups, steps = -(-rows // GROUP_ROWS), -(-columns // STEP_INPUTS)
    values, offsets = [], []
    masks = torch.zeros(groups, steps, GROUP_ROWS, dtype=torch.int64)
    for group in range(groups):
        offsets.append(len(values))
        for step in range(steps):
            for r in range(GROUP_ROWS):
                row = group * GROUP_ROWS + r
                if row >= rows:
                    continue
                for k in range(step * STEP_INPUTS, min(columns, (step + 1) * STEP_INPUTS)):
                    if weight[row, k] != 0:
                        masks[group, step, r] |= 1 << (k - step * STEP_INPUTS)
                        values.append(weight[row, k])
    offsets.append(len(values))
    signed = torch.where(masks >= 2**31, masks - 2**32, masks).to(torch.int32)
    kept = torch.stack(values) if values else weight.new_zeros(0)
    return torch.cat([kept, weight.new_zeros(PAD_VALUES)]), signed, torch.tensor(offsets)


@pytest.mark.parametrize(("rows", "columns"), SHAPES[:7])
def test_group_layout_is_its_definition(rows, columns):
    """Rows that keep nothing, rows that keep everything, a last group of fewer rows and a
    last step of fewer inputs: the built layout is the definition's, also placed a group at
    a time."""
    generator = torch.Generator().manual_seed(rows * 1000 + columns)
    weight = integer_sparse(rows, columns, 0.5, torch.bfloat16, generator)
    weight[0] = 0
    weight[-1] = torch.randint(1, 4, (columns,), generator=generator).to(torch.bfloat16)
    values, bitmask, row_offsets = compress_bitmask(weight)
    expected = slow_group_layout(weight)
    for block_groups in (1, 128):
        built = group_layout(values, bitmask, row_offsets, columns, block_groups)
        for got, want in zip(built, expected, strict=True):
            assert torch.equal(got, want), (rows, columns, block_groups)


@needs_kernels
@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("path", BITMASK_PATHS)
def test_grouped_op_is_exact_on_integer_values(path):
    """Sparsities from none to all (95 % among them), 1 to 70 tokens, bfloat16 and float32
    activations, with bias, on each path and instruction set: the exact products rounded
    once, in bfloat16 where the tiles are (and where float32 x takes the tiles: below the
    ``avx512_bf16`` kernels, or float32 x on them), bit for bit; the op's decompression is
    the weight."""
    generator = torch.Generator().manual_seed(5)
    bf16_tiles = kernels.cpu_isa() == "avx512_bf16"
    for rows, columns in SHAPES:
        for sparsity in (0.0, 0.5, 0.65, 0.95, 1.0):
            weight = integer_sparse(rows, columns, sparsity, torch.bfloat16, generator)
            layer = group_layout(*compress_bitmask(weight), columns)
            assert torch.equal(kernels.grouped_decompress_cpu(*layer, columns, rows), weight)
            for tokens in (1, 3, 5, 17, 70):
                for x_dtype in (torch.bfloat16, torch.float32):
                    x = torch.randint(-3, 4, (tokens, columns), generator=generator).to(x_dtype)
                    bias = torch.randint(-3, 4, (rows,), generator=generator).to(x_dtype)
                    tiles = path in ("tiles", "brgemm") or not kernels.gemm_runs(
                        x_dtype, torch.bfloat16
                    )
                    exact_in = torch.bfloat16 if tiles and bf16_tiles else x_dtype
                    exact = x.to(exact_in).double() @ weight.double().t()
                    exact = exact + bias.to(exact_in).double()
                    got = kernels.grouped_cpu_linear(
                        x, *layer, bias, columns, rows, PathThresholds.only(path)
                    )
                    assert got.dtype == x_dtype
                    assert torch.equal(got, exact.to(exact_in).to(x_dtype)), (rows, columns, tokens)


@needs_kernels
@pytest.mark.skipif(
    not kernels.gemm_runs(torch.bfloat16, torch.bfloat16),
    reason="the unstructured GEMM runs on avx512_bf16 kernels only",
)
def test_a_wide_layer_at_many_tokens_is_exact_in_passes_of_inputs():
    """Where 512 tokens' packed inputs pass the GEMM's cap (9000 inputs), it runs passes of
    inputs, their float32 sums kept between them, and past 512 tokens passes of tokens too:
    the exact products rounded once, bit for bit, in the grouped layout and in rows; 200
    rows, so that each thread takes several blocks of rows (whose sums a pass must not find
    left in its buffer by the pass before)."""
    generator = torch.Generator().manual_seed(9)
    rows, columns = 200, 9000
    weight = integer_sparse(rows, columns, 0.5, torch.bfloat16, generator)
    stored = compress_bitmask(weight)
    layer = group_layout(*stored, columns)
    gemm = PathThresholds.only("gemm")
    for tokens in (300, 513):
        x = torch.randint(-3, 4, (tokens, columns), generator=generator).to(torch.bfloat16)
        bias = torch.randint(-3, 4, (rows,), generator=generator).to(torch.bfloat16)
        exact = (x.double() @ weight.double().t() + bias.double()).to(torch.bfloat16)
        grouped = kernels.grouped_cpu_linear(x, *layer, bias, columns, rows, gemm)
        in_rows = kernels.bitmask_cpu_linear(x, *stored, bias, columns, gemm)
        assert torch.equal(grouped, exact) and torch.equal(in_rows, exact), tokens


@needs_kernels
def test_grouped_op_refuses_tensors_that_do_not_fit_names_them():
    weight = integer_sparse(9, 40, 0.5, torch.bfloat16, torch.Generator().manual_seed(2))
    values, masks, offsets = group_layout(*compress_bitmask(weight), 40)
    x = torch.ones(1, 40, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="group_masks must be a contiguous \\[2, 2, 8\\]"):
        kernels.grouped_cpu_linear(x, values, masks[:1], offsets, None, 40, 9)
    with pytest.raises(RuntimeError, match="group_offsets must be"):
        kernels.grouped_cpu_linear(x, values, masks, offsets[:-1], None, 40, 9)
    with pytest.raises(RuntimeError, match="32 values past the last group"):
        kernels.grouped_cpu_linear(x, values[:-1], masks, offsets, None, 40, 9)
    with pytest.raises(RuntimeError, match="values must be a contiguous 1-D bfloat16"):
        kernels.grouped_cpu_linear(x, values.float(), masks, offsets, None, 40, 9)


@needs_kernels
def test_the_served_module_holds_the_grouped_layout_where_it_runs(monkeypatch):
    """``cpu_serving_kernel`` serves a bfloat16 unstructured layer grouped on ``avx512_bf16``
    kernels (and in rows below them); a module over the grouped layer holds the grouped
    tensors only, counts their bytes, and gives F.linear of the weight exactly (from int32
    offsets, as the legacy format may hold, too); a moved offset is refused naming the
    layer."""
    from whisper_sparse.cpu import linear
    from whisper_sparse.cpu.plans import CpuPlan
    from whisper_sparse.cpu.served_layer import GroupedLayer, RowsLayer, served_layer
    from whisper_sparse.format.bits import CorruptCheckpointError
    from whisper_sparse.weight_bytes import layer_weight_bytes

    generator = torch.Generator().manual_seed(7)
    weight = integer_sparse(20, 96, 0.6, torch.bfloat16, generator)
    values, bitmask, row_offsets = compress_bitmask(weight)
    plan = CpuPlan(faster_at_decode=True)

    def grouped(offsets):
        layer = served_layer(values, bitmask, 96, offsets, "l", grouped=True)
        return linear.CpuSparseLinear.serving(layer, plan)

    module = grouped(row_offsets)
    names = {name for name, _ in module.named_parameters()}
    assert names == {"compressed", "group_masks", "group_offsets", "shape"}
    assert module.density() == pytest.approx(values.numel() / (20 * 96))
    held, dense = layer_weight_bytes(module)
    assert dense == 20 * 96 * 2
    assert held == (values.numel() + PAD_VALUES) * 2 + 3 * 3 * 8 * 4 + 4 * 8
    x = torch.randint(-3, 4, (3, 96), generator=generator).to(torch.bfloat16)
    assert torch.equal(module(x), F.linear(x.double(), weight.double()).to(torch.bfloat16))
    moved = row_offsets.clone()
    moved[3] += 1
    with pytest.raises(CorruptCheckpointError, match=r"l.row_offsets\[3\]"):
        grouped(moved)
    assert torch.equal(grouped(row_offsets.int())(x), module(x))
    monkeypatch.setattr(linear, "cpu_plan", lambda *args: plan)
    served = linear.cpu_serving_kernel(values, bitmask, 96, "l", row_offsets)
    kind = GroupedLayer if kernels.cpu_isa() == "avx512_bf16" else RowsLayer
    assert type(served.served) is kind
    assert torch.equal(served(x), module(x))
