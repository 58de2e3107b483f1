"""The sparse CPU op against its pure-torch reference (``format.decompress_24`` then
``F.linear``), on every instruction set this CPU runs (``supported_isas``: AVX2, AVX-512,
AVX-512 with BF16), so a CI machine of either kind checks what it can run.

Integer-valued activations and weights make every product and every float32 sum exact, so
the op must equal the float64 reference rounded once to the output dtype, bit for bit,
whatever the order of its sums: a misplaced or missing kept value cannot hide in a
tolerance. Random real values are then checked against a bound on float32 rounding."""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import run_emulated_kernel_check
from whisper_sparse.cpu.build import SOURCE_DIR
from whisper_sparse.cpu.cpu_info import cpu_flag_set
from whisper_sparse.cpu.op import (
    CPU_ISAS,
    NO_TILES,
    PathThresholds,
    bitmask_cpu_linear,
    bitmask_decompress_cpu,
    brgemm_kernel,
    cpu_isa,
    cpu_kernels_unavailable,
    decompress_cpu,
    gemm_runs,
    grouped_cpu_linear,
    reference_linear,
    set_cpu_isa,
    supported_isas,
    two_four_cpu_linear,
)
from whisper_sparse.cpu.op import PATHS as OP_PATHS
from whisper_sparse.cpu.plans import plan_from_timings
from whisper_sparse.cpu.served_layer import random_two_four
from whisper_sparse.format.bitmask import compress_bitmask
from whisper_sparse.format.two_four import compress_24, decompress_24

if cpu_kernels_unavailable():
    pytest.skip(cpu_kernels_unavailable(), allow_module_level=True)

# (out, in): inputs not a multiple of 8, 16 or 32 (tails of every kernel), a row group of
# four and its remainder, a 7B-like input size and a tensor-parallel half of it
SHAPES = [
    (1, 4),
    (5, 12),
    (16, 32),
    (33, 100),
    (64, 132),
    (7, 36),
    (130, 260),
    (17, 4100),
    (8, 2048),
]
TOKENS = [1, 2, 3, 4, 5, 9, 16, 33, 64, 100]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=supported_isas())
def isa(request):
    set_cpu_isa(request.param)
    yield request.param
    set_cpu_isa("auto")


def integer_two_four(rows: int, columns: int, dtype, generator) -> torch.Tensor:
    weight = torch.randint(-3, 4, (rows, columns), generator=generator).to(dtype)
    groups = weight.reshape(rows, -1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, torch.rand(groups.shape, generator=generator).topk(2, dim=-1).indices, True)
    return (groups * keep).reshape(rows, columns)


def test_the_isas_follow_the_cpu_flags():
    """AVX2 with FMA, then AVX-512 F/BW/VL/VBMI2, then BF16: read from /proc/cpuinfo here,
    as the op reads them from CPUID."""
    flags = cpu_flag_set()
    expected = []
    if {"avx2", "fma"} <= flags:
        expected.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vbmi2"} <= flags:
            expected.append("avx512")
            if "avx512_bf16" in flags:
                expected.append("avx512_bf16")
    assert supported_isas() == expected
    assert cpu_isa() == expected[-1]
    if len(expected) < len(CPU_ISAS):  # a cap above what the CPU runs is refused
        with pytest.raises(RuntimeError, match="this CPU has no"):
            set_cpu_isa(CPU_ISAS[len(expected)])


def test_the_tiles_micro_kernel_runs_where_onednn_runs_bfloat16():
    """A micro-kernel runs the brgemm tiles on every AVX-512 BF16 CPU that torch's oneDNN
    drives (so the exactness tests' "brgemm" path is a micro-kernel's there, not ATen's
    tiles): "amx" (the op's AMX tiles) exactly where the CPU has AMX-BF16 and AMX-TILE."""
    kernel = brgemm_kernel()
    assert kernel in ("amx", "avx512", "none")
    if cpu_isa() == "avx512_bf16":
        assert kernel != "none"
        assert (kernel == "amx") is ({"amx_bf16", "amx_tile"} <= cpu_flag_set())
    if not {"amx_bf16", "amx_tile"} & cpu_flag_set():
        assert kernel != "amx"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decompress_kernel_equals_the_format(isa, dtype):
    generator = torch.Generator().manual_seed(0)
    for rows, columns in SHAPES:
        weight = integer_two_four(rows, columns, dtype, generator)
        compressed, bitmask = compress_24(weight)
        assert torch.equal(decompress_cpu(compressed, bitmask, columns), weight), (rows, columns)
        assert torch.equal(decompress_24(compressed, bitmask, (rows, columns)), weight)


# the thresholds of each path: the GEMMs run where gemm_runs says, the rows elsewhere;
# "lanes": a 2:4 layer in the unstructured GEMM (an unstructured layer's GEMM); "brgemm": the
# tiles through a micro-kernel where one runs (brgemm_kernel: AMX or oneDNN's), else ATen's
PATHS = {path: PathThresholds.only(path) for path in OP_PATHS}
BITMASK_PATHS = [path for path in PATHS if path != "lanes"]


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("path", list(PATHS))
def test_op_is_exact_on_integer_values(isa, weight_dtype, x_dtype, path):
    """Row kernels and the GEMMs (the 2:4 one, and the unstructured one over the 2:4 rows):
    float32 sums of exact products, the bias added, rounded once to ``x``'s dtype. Tiles:
    the dense GEMM with the bias, in bfloat16 for bfloat16 weights where the kernels are
    ``avx512_bf16`` (``x`` rounded to it, the result rounded once to it, then to ``x``'s
    dtype), else in float32 as the row kernels sum."""
    generator = torch.Generator().manual_seed(1)
    for rows, columns in SHAPES:
        weight = integer_two_four(rows, columns, weight_dtype, generator)
        compressed, bitmask = compress_24(weight)
        for tokens in TOKENS:
            x = torch.randint(-3, 4, (tokens, columns), generator=generator).to(x_dtype)
            bias = torch.randint(-3, 4, (rows,), generator=generator).to(x_dtype)
            bf16_tiles = (
                path in ("tiles", "brgemm")
                and weight_dtype == torch.bfloat16
                and isa == "avx512_bf16"
            )
            exact_in = torch.bfloat16 if bf16_tiles else x_dtype
            exact = x.to(exact_in).double() @ weight.double().t() + bias.to(exact_in).double()
            expected = exact.to(exact_in).to(x_dtype)
            got = two_four_cpu_linear(x, compressed, bitmask, bias, columns, PATHS[path])
            assert got.dtype == x_dtype and got.shape == (tokens, rows)
            assert torch.equal(got, expected), (rows, columns, tokens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_follows_the_reference_on_real_values(isa, dtype):
    """Random weights and activations, every token count from 1 to 4096 in a few steps, with
    and without bias: within float32 rounding of the sums, plus one rounding to bfloat16."""
    generator = torch.Generator().manual_seed(2)
    eps = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    for rows, columns in [(48, 4096), (33, 100), (64, 516)]:
        weight = random_two_four(rows, columns, dtype, seed=rows)
        compressed, bitmask = compress_24(weight)
        for tokens in (1, 7, 64, 511, 4096):
            x = torch.randn(tokens, columns, generator=generator).to(dtype)
            bias = torch.randn(rows, generator=generator).to(dtype) if tokens % 2 else None
            reference = reference_linear(x, compressed, bitmask, bias, columns, torch.float64)
            scale = x.double().abs() @ weight.double().abs().t() + 1
            for thresholds in PATHS.values():
                got = two_four_cpu_linear(x, compressed, bitmask, bias, columns, thresholds)
                error = (got.double() - reference).abs()
                assert (error <= 1e-5 * scale + eps * reference.abs()).all(), (tokens, columns)


def test_op_keeps_leading_dimensions_and_refuses_bad_tensors():
    weight = random_two_four(16, 64, torch.float32)
    compressed, bitmask = compress_24(weight)
    x = torch.randn(2, 3, 64)
    assert torch.allclose(
        two_four_cpu_linear(x, compressed, bitmask, None, 64), F.linear(x, weight), atol=1e-5
    )
    with pytest.raises(RuntimeError, match=r"x must be a CPU tensor \[\.\.\., 64\]"):
        two_four_cpu_linear(torch.randn(3, 60), compressed, bitmask, None, 64)
    with pytest.raises(RuntimeError, match="bitmask must be a contiguous"):
        two_four_cpu_linear(x, compressed, bitmask[:, :4], None, 64)
    with pytest.raises(RuntimeError, match="in_features must be a positive multiple of 4"):
        two_four_cpu_linear(x, compressed, bitmask, None, 62)


def test_op_is_a_custom_op_that_compiled_graphs_keep():
    """torch.library's own checks (schema, fake tensor, autograd registration), and a
    torch.compile'd function that calls the op equals the eager one."""
    weight = random_two_four(32, 128, torch.bfloat16)
    compressed, bitmask = compress_24(weight)
    x = torch.randn(5, 128).to(torch.bfloat16)
    op = torch.ops.whisper_sparse_cpu.linear.default
    for t in PATHS.values():
        torch.library.opcheck(
            op,
            (
                x,
                compressed,
                bitmask,
                None,
                128,
                t.gemm_from,
                t.tiled_from,
                t.lanes_until,
                t.brgemm_until,
            ),
            test_utils=("test_schema", "test_faketensor"),
        )

    def layer(x):
        return torch.nn.functional.silu(two_four_cpu_linear(x, compressed, bitmask, None, 128))

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def timings_table(points: list[tuple]) -> list[dict]:
    """``(tokens, rows, gemm, tiles, dense)`` seconds per ladder point (gemm None: it does
    not run)."""
    return [
        {"tokens": t, "rows_s": r, "gemm_s": g, "tiles_s": s, "dense_s": d}
        for t, r, g, s, d in points
    ]


def test_plan_runs_each_token_count_on_the_path_that_won_there():
    timings = timings_table(
        [
            (1, 1.0, 3.0, 3.0, 2.0),
            (4, 2.0, 3.0, 3.0, 2.0),
            (16, 4.0, 3.5, 5.0, 3.0),
            (64, 9.0, 5.0, 6.0, 4.0),
            (256, 30.0, 20.0, 15.0, 14.0),
        ]
    )
    plan = plan_from_timings(timings)
    assert (plan.gemm_from, plan.tiled_from, plan.faster_at_decode) == (16, 256, True)
    assert [plan.path(t) for t in (1, 15, 16, 255, 256, 4096)] == [
        "rows",
        "rows",
        "gemm",
        "gemm",
        "tiles",
        "tiles",
    ]
    assert plan.speedups[0] == (1, 2.0) and plan.speedups[2] == (16, 3.0 / 3.5)
    assert "gemm from 16" in plan.describe() and "tiles from 256" in plan.describe()
    slower = "slower than dense at 16, 64, 256 tokens: WHISPER_MODIFIERS_SPARSE=dense"
    assert slower in plan.describe()
    faster = timings_table([(t, 1.0, 1.0, 1.0, 2.0) for t in (1, 4, 16)])
    assert "slower" not in plan_from_timings(faster).describe()
    timings[4]["tiles_s"] = 19.5  # faster than the GEMM, but within its margin: the GEMM keeps it
    assert plan_from_timings(timings).tiled_from == NO_TILES
    timings[4]["tiles_s"] = 25.0  # tiles lose at the top: never tiles, the GEMM to the end
    timings[0]["rows_s"] = 2.5  # slower than dense at one token
    plan = plan_from_timings(timings)
    assert (plan.gemm_from, plan.tiled_from, plan.faster_at_decode) == (16, NO_TILES, False)
    timings[2]["gemm_s"] = 4.5  # the GEMM loses at 16 tokens: from 64, after its last loss
    assert plan_from_timings(timings).gemm_from == 64


def test_plan_takes_the_micro_kernels_tiles_where_they_beat_atens():
    """Where the micro-kernel's tiles are timed ("brgemm", on AMX), each count weighs the
    faster tiles, and the tiles run through the micro-kernel up to the lowest count from
    which ATen's were never slower (an AMX Xeon's host: the micro-kernel won 4096 x 11008 at
    16 tokens, 4.8 against 12.2 ms, and lost at 512, 92 against 51; one choice for all the
    tiles' counts took ATen's at 16, 0.54x dense)."""
    timings = timings_table(
        [
            (1, 1.0, 3.0, 3.0, 2.0),
            (4, 2.0, 3.0, 3.0, 2.0),
            (16, 4.0, 3.5, 5.0, 5.0),
            (64, 9.0, 8.0, 9.0, 9.0),
        ]
    )
    for timing, brgemm in zip(timings, (4.0, 4.0, 2.0, 4.0), strict=True):
        timing["brgemm_s"] = brgemm
    plan = plan_from_timings(timings)
    assert (plan.gemm_from, plan.tiled_from, plan.brgemm_until) == (NO_TILES, 16, NO_TILES)
    assert [plan.path(t) for t in (1, 15, 16, 64)] == ["rows", "rows", "brgemm", "brgemm"]
    assert plan.speedups[2] == (16, 2.5) and "brgemm tiles from 16" in plan.describe()
    timings[2]["brgemm_s"], timings[3]["brgemm_s"] = 3.0, 12.0  # the faster at 16 only
    timings[3]["tiles_s"] = 7.0
    plan = plan_from_timings(timings)  # the micro-kernel's at 16, ATen's from 64
    assert (plan.tiled_from, plan.brgemm_until) == (16, 64)
    assert [plan.path(t) for t in (15, 16, 63, 64)] == ["rows", "brgemm", "brgemm", "tiles"]
    assert [ratio for _, ratio in plan.speedups[2:]] == [5.0 / 3.0, 9.0 / 7.0]
    assert "brgemm tiles from 16; tiles from 64 tokens" in plan.describe()
    timings[2]["tiles_s"], timings[2]["brgemm_s"] = 3.0, 3.2  # ATen's at every tiled count
    plan = plan_from_timings(timings)
    assert (plan.tiled_from, plan.path(16), plan.path(64)) == (16, "tiles", "tiles")
    assert "brgemm" not in plan.describe()
    timings[2]["tiles_s"] = 5.0
    for timing in timings:  # not timed (no AMX): ATen's tiles win from 64 alone
        del timing["brgemm_s"]
    assert plan_from_timings(timings).tiled_from == 64


def test_plan_compares_paths_by_their_rounds_ratios():
    """Where the paths were timed round by round (``{name}_rounds``), two paths compare by
    the median of their rounds' ratios, not by their medians: a spell that slowed the GEMM
    alone in one round, and both in two others, does not hand 512 tokens to the tiles, whose
    median is 0.77x the GEMM's but which won most rounds by 3-4 % only (``TILES_MARGIN``).
    The rounds of the faster of ATen's and the micro-kernel's tiles, and of the lanes GEMM
    below ``lanes_until``, stand for theirs."""

    def timed(point, **rounds):
        for name, values in rounds.items():
            point |= {f"{name}_rounds": values, f"{name}_s": statistics.median(values)}

    timings = timings_table([(1, 1.0, 3.0, 3.0, 2.0), (512, 300.0, 100.0, 96.0, 100.0)])
    timed(
        timings[1],
        gemm=[100.0, 101.0, 130.0, 250.0, 260.0],
        rows=[300.0] * 5,
        tiles=[97.0, 98.0, 100.0, 240.0, 245.0],
    )
    assert timings[1]["tiles_s"] / timings[1]["gemm_s"] < 0.8
    assert plan_from_timings([t | {"gemm_rounds": None} for t in timings]).tiled_from == 512
    assert plan_from_timings(timings).tiled_from == NO_TILES  # rounds' ratios: median 0.96x
    timed(timings[1], tiles=[90.0, 93.0, 94.0, 230.0, 240.0])  # won most rounds by 6 % or more
    assert plan_from_timings(timings).tiled_from == 512
    timed(timings[1], brgemm=[99.0, 99.0, 97.0, 250.0, 250.0])
    assert plan_from_timings(timings).tiled_from == 512  # ATen's tiles the faster (94 ms)
    timings[1]["brgemm_s"] = 92.0  # the micro-kernel's median the faster: its rounds stand
    assert plan_from_timings(timings).tiled_from == NO_TILES
    # dense against the op's path, too: rounds' ratios (1.0, 1.0, 0.77, 1.0, 1.0) at 512
    timed(timings[1], dense=[100.0, 101.0, 100.0, 250.0, 260.0])
    assert plan_from_timings(timings).speedups[1] == (512, 1.0)
    timed(timings[0], rows=[1.0, 2.0, 3.0], dense=[0.9, 3.5, 2.8])  # lost two rounds of 3
    assert timings[0]["dense_s"] / timings[0]["rows_s"] == 1.4  # by medians it won
    assert not plan_from_timings(timings).faster_at_decode
    lanes = timings_table([(16, 4.0, 4.0, 9.0, 4.0), (64, 8.0, 7.0, 20.0, 8.0)])
    lanes[0] |= {
        "rows_rounds": [4.2, 4.1, 4.3],
        "gemm_rounds": [9.0] * 3,
        "lanes_s": 5.0,
        "lanes_rounds": [3.9, 4.0, 4.0],
    }
    lanes[1] |= {
        "rows_rounds": [7.0, 7.1, 7.2],
        "gemm_rounds": [6.0] * 3,
        "lanes_s": 3.0,
        "lanes_rounds": [7.0] * 3,
    }
    for point in lanes:
        point["tiles_rounds"] = [99.0] * 3
    plan = plan_from_timings(lanes)  # at 16 the lanes GEMM's rounds, not its median, meet the rows'
    assert (plan.gemm_from, plan.lanes_until) == (16, 64)


def test_a_two_four_plan_takes_the_lanes_gemm_where_it_beat_the_two_four_gemm():
    """A 2:4 layer's unstructured GEMM ("lanes") runs from the GEMM's start until the 2:4
    GEMM's last loss to it; the rows weigh against the faster of the two there."""
    timings = timings_table(
        [
            (1, 1.0, 3.0, 3.0, 2.0),
            (4, 2.0, 3.0, 3.0, 2.0),
            (16, 4.0, 4.2, 5.0, 4.0),
            (32, 6.0, 5.0, 6.0, 5.0),
            (64, 9.0, 7.0, 8.0, 7.0),
            (256, 30.0, 20.0, 25.0, 21.0),
        ]
    )
    lanes = {1: 3.1, 4: 3.2, 16: 3.5, 32: 4.5, 64: 7.5, 256: 24.0}
    for timing in timings:
        timing["lanes_s"] = lanes[timing["tokens"]]
    plan = plan_from_timings(timings)
    # the 2:4 GEMM loses to the rows at 16, the lanes GEMM wins there
    assert (plan.gemm_from, plan.lanes_until, plan.tiled_from) == (16, 64, NO_TILES)
    assert [plan.path(t) for t in (1, 15, 16, 63, 64, 4096)] == [
        "rows",
        "rows",
        "lanes",
        "lanes",
        "gemm",
        "gemm",
    ]
    assert plan.speedups[2] == (16, 4.0 / 3.5) and plan.speedups[4] == (64, 1.0)
    assert "rows from 1; lanes from 16; gemm from 64 tokens" in plan.describe()
    timings[4]["lanes_s"] = 6.0  # the lanes GEMM wins at 64 too: until 256
    assert plan_from_timings(timings).lanes_until == 256
    for timing in timings:  # the lanes GEMM never wins: the 2:4 GEMM from its first win
        timing["lanes_s"] = 99.0
    plan = plan_from_timings(timings)
    assert (plan.gemm_from, plan.path(40)) == (32, "gemm") and "lanes" not in plan.describe()


def test_plan_without_the_gemm_keeps_rows_and_tiles():
    """Where the GEMM does not run (no avx512_bf16, or float32), the plan has rows and tiles."""
    timings = timings_table(
        [
            (1, 1.0, None, 3.0, 1.5),
            (4, 2.0, None, 3.0, 2.0),
            (16, 4.0, None, 3.5, 3.0),
            (64, 9.0, None, 5.0, 4.0),
        ]
    )
    plan = plan_from_timings(timings)
    assert (plan.gemm_from, plan.tiled_from, plan.faster_at_decode) == (NO_TILES, 16, True)
    assert "gemm" not in plan.describe()


def test_the_gemm_runs_bfloat16_on_avx512_bf16_only(isa):
    """gemm_runs follows the kernels: a token count given to the GEMM elsewhere takes the
    row kernels (the same bits as the rows path)."""
    expected = isa == "avx512_bf16"
    assert gemm_runs(torch.bfloat16, torch.bfloat16) is expected
    assert not gemm_runs(torch.float32, torch.bfloat16)
    assert not gemm_runs(torch.float32, torch.float32)


def test_a_machine_that_cannot_build_says_why_in_one_line(tmp_path):
    """No compiler: the op is unavailable, with a one-line reason, and nothing is cached."""
    script = (
        "from whisper_sparse.cpu.op import cpu_kernels_unavailable\n"
        "print('REASON', cpu_kernels_unavailable())\n"
    )
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-compiler"),
        "WHISPER_MODIFIERS_CACHE": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("REASON")]
    assert line.startswith("REASON the 2:4 CPU kernels could not be built:"), done.stderr[-2000:]
    assert not list((tmp_path / "cache").glob("cpu_kernels/*/*.so"))


def test_avx512_and_avx2_kernels_are_right_on_any_cpu(tmp_path):
    """The AVX-512 sources compiled with tests/native/avx512_emulation.h (the intrinsics in
    plain C++, lane by lane), and the AVX2 ones as they are (every CPU the op serves has
    AVX2), against a scalar reference on integer values: the AVX-512 kernels' lanes, masks
    and tails are checked on CPUs without AVX-512 too; under AddressSanitizer, so a load past
    the values, masks or activations a kernel is given fails (the unstructured kernels load
    up to 32 values at a time wherever the layer has them)."""
    native = Path(__file__).with_name("native")
    sources = [
        native / "check_kernels.cpp",
        SOURCE_DIR / "avx2.cpp",
        SOURCE_DIR / "avx2_bitmask.cpp",
        SOURCE_DIR / "avx512.cpp",
        SOURCE_DIR / "avx512_bf16.cpp",
        SOURCE_DIR / "avx512_bf16_gemm.cpp",
        SOURCE_DIR / "avx512_bf16_bitmask_gemm.cpp",
        SOURCE_DIR / "avx512_bf16_grouped.cpp",
    ]
    run_emulated_kernel_check(tmp_path, sources)


def test_a_new_build_of_the_op_measures_its_plans_again(tmp_path, monkeypatch):
    """A plan is kept per build of the op (its sources, torch, compiler): a plan measured
    with other kernels is not reused, one measured with these is."""
    from whisper_sparse.cpu import plans as cpu_plans

    measured = []
    plan = cpu_plans.CpuPlan(
        tiled_from=16, gemm_from=4, faster_at_decode=True, speedups=((1, 2.0),)
    )

    def measure(out_features, in_features, dtype, density=None):
        measured.append(cpu_plans.loaded_build_key())
        return plan, []

    monkeypatch.setenv("WHISPER_MODIFIERS_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_plans, "measure_cpu_plan", measure)
    monkeypatch.setattr(cpu_plans, "_known", {})
    assert cpu_plans.cpu_plan(8, 32, torch.float32) == plan
    monkeypatch.setattr(cpu_plans, "_known", {})  # a new process: from the file, the same plan
    assert cpu_plans.cpu_plan(8, 32, torch.float32) == plan
    assert len(measured) == 1
    monkeypatch.setattr(cpu_plans, "loaded_build_key", lambda: "another build")
    cpu_plans.cpu_plan(8, 32, torch.float32)
    assert measured[-1] == "another build" and len(measured) == 2


def test_unstructured_layers_have_a_plan_per_density_step(tmp_path, monkeypatch):
    """An unstructured layer's plan is measured at its density rounded to the step, apart
    from the 2:4 plan of the same shape: 0.34 and 0.36 share one, 0.5 has its own."""
    from whisper_sparse.cpu import plans as cpu_plans

    measured = []

    def measure(out_features, in_features, dtype, density=None):
        measured.append(density)
        return cpu_plans.CpuPlan(faster_at_decode=True), []

    monkeypatch.setenv("WHISPER_MODIFIERS_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_plans, "measure_cpu_plan", measure)
    monkeypatch.setattr(cpu_plans, "_known", {})
    for density in (None, 0.34, 0.36, 0.5, None):
        cpu_plans.cpu_plan(8, 32, torch.float32, density)
    assert measured == [None, 0.35, 0.5]


# ---- unstructured layers (bitmask_format): the same kernels, their pointers advancing by
# each mask's popcount, and the tiles over rows decompressed from row offsets

BITMASK_SHAPES = [(1, 1), (5, 12), (7, 37), (16, 64), (33, 100), (17, 4100), (9, 2049), (70, 1058)]


def integer_sparse(rows: int, columns: int, sparsity: float, dtype, generator) -> torch.Tensor:
    weight = torch.randint(-3, 4, (rows, columns), generator=generator).float()
    weight[torch.rand(rows, columns, generator=generator) < sparsity] = 0
    return weight.to(dtype)


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("path", BITMASK_PATHS)
def test_bitmask_op_is_exact_on_integer_values(isa, weight_dtype, x_dtype, path):
    """Every sparsity from none to all, inputs that are not a multiple of 8, 16 or 32, 1 to
    70 tokens, on each path (the GEMM where it runs: bfloat16 on ``avx512_bf16``, any input
    size, its tiles of 16 and 32 tokens and its blocking past 64; else the row kernels):
    the float64 reference rounded once (the tiles in bfloat16 where the 2:4 op's are), bit
    for bit; and the op's own decompression is the format's."""
    generator = torch.Generator().manual_seed(3)
    for rows, columns in BITMASK_SHAPES:
        for sparsity in (0.0, 0.5, 0.65, 1.0):
            weight = integer_sparse(rows, columns, sparsity, weight_dtype, generator)
            values, bitmask, row_offsets = compress_bitmask(weight)
            assert torch.equal(
                bitmask_decompress_cpu(values, bitmask, row_offsets, columns), weight
            )
            for tokens in (1, 2, 3, 5, 17, 30, 70):
                x = torch.randint(-3, 4, (tokens, columns), generator=generator).to(x_dtype)
                bias = torch.randint(-3, 4, (rows,), generator=generator).to(x_dtype)
                bf16_tiles = (
                    path in ("tiles", "brgemm")
                    and weight_dtype == torch.bfloat16
                    and isa == "avx512_bf16"
                )
                exact_in = torch.bfloat16 if bf16_tiles else x_dtype
                exact = x.to(exact_in).double() @ weight.double().t() + bias.to(exact_in).double()
                got = bitmask_cpu_linear(
                    x, values, bitmask, row_offsets, bias, columns, PATHS[path]
                )
                assert torch.equal(got, exact.to(exact_in).to(x_dtype)), (rows, columns, tokens)


def test_bitmask_op_follows_the_reference_on_real_values(isa):
    generator = torch.Generator().manual_seed(4)
    for sparsity in (0.5, 0.65):
        weight = torch.randn(96, 1000, generator=generator)
        weight[torch.rand(96, 1000, generator=generator) < sparsity] = 0
        weight = weight.to(torch.bfloat16)
        values, bitmask, row_offsets = compress_bitmask(weight)
        for tokens in (1, 7, 300, 4096):
            x = torch.randn(tokens, 1000, generator=generator).to(torch.bfloat16)
            reference = F.linear(x.double(), weight.double())
            scale = x.double().abs() @ weight.double().abs().t() + 1
            for path in BITMASK_PATHS:
                got = bitmask_cpu_linear(x, values, bitmask, row_offsets, None, 1000, PATHS[path])
                error = (got.double() - reference).abs()
                assert (error <= 1e-5 * scale + 2.0**-8 * reference.abs()).all(), tokens


@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_tiles_are_exact_across_tiles(isa, weight_dtype):
    """A layer of several tiles (at least 128 rows each: 300 rows make 128 + 128 + 44, the
    threads taking whole tiles), 2:4 and unstructured, with bias: each tile's products and
    bias land in their own columns, bit for bit as the exact reference rounded once (in
    bfloat16 where the tiles are); and so under ``torch.inference_mode``, as vLLM calls the
    op (the threads run tensor ops on its inference tensors)."""
    generator = torch.Generator().manual_seed(6)
    rows, columns, tokens = 300, 4100, 17
    bf16_tiles = weight_dtype == torch.bfloat16 and isa == "avx512_bf16"
    exact_in = torch.bfloat16 if bf16_tiles else torch.float32
    x = torch.randint(-3, 4, (tokens, columns), generator=generator).float()
    bias = torch.randint(-3, 4, (rows,), generator=generator).float()
    two_four = integer_two_four(rows, columns, weight_dtype, generator)
    unstructured = integer_sparse(rows, columns, 0.5, weight_dtype, generator)
    compressed_24, stored = compress_24(two_four), compress_bitmask(unstructured)
    layers = {  # layout: (weight, the op on its stored tensors at a path's thresholds)
        "2:4": (
            two_four,
            lambda thresholds: two_four_cpu_linear(x, *compressed_24, bias, columns, thresholds),
        ),
        "unstructured": (
            unstructured,
            lambda thresholds: bitmask_cpu_linear(x, *stored, bias, columns, thresholds),
        ),
    }
    for layout, (weight, run) in layers.items():
        exact = x.double() @ weight.double().t() + bias.double()
        expected = exact.to(exact_in).float()
        for path, inference in itertools.product(("tiles", "brgemm"), (False, True)):
            with torch.inference_mode(inference):
                got = run(PATHS[path])
            assert torch.equal(got, expected), (layout, path, inference)


@pytest.mark.skipif(
    cpu_kernels_unavailable() is not None or brgemm_kernel() != "amx",
    reason="the op's AMX tiles run only on a CPU with AMX-BF16 (and avx512_bf16 kernels)",
)
def test_amx_tiles_are_exact_on_integer_values():
    """The brgemm path on AMX (the op's own tiles, ``kernels/op_amx.cpp``): 2:4, unstructured
    rows and the grouped layout, with and without bias, row counts off the tiles' 32 rows
    (several blocks per thread), inputs off their 32 and token counts off their 16, on both
    sides of the few-tokens block size (128): the exact products, rounded once to bfloat16,
    bit for bit."""
    from whisper_sparse.cpu.grouped_layout import group_layout

    generator = torch.Generator().manual_seed(7)
    brgemm = PATHS["brgemm"]
    for rows, columns in [(300, 4100), (33, 100), (97, 1000)]:
        two_four = integer_two_four(rows, columns, torch.bfloat16, generator)
        unstructured = integer_sparse(rows, columns, 0.65, torch.bfloat16, generator)
        values, bitmask, offsets = compress_bitmask(unstructured)
        group_values, group_masks, group_offsets = group_layout(values, bitmask, offsets, columns)
        compressed, two_four_bitmask = compress_24(two_four)
        runs = {  # layout: (weight, the op on its stored tensors, given x and bias)
            "2:4": (
                two_four,
                partial(
                    two_four_cpu_linear,
                    compressed=compressed,
                    bitmask=two_four_bitmask,
                    in_features=columns,
                ),
            ),
            "unstructured": (
                unstructured,
                partial(
                    bitmask_cpu_linear,
                    values=values,
                    bitmask=bitmask,
                    row_offsets=offsets,
                    in_features=columns,
                ),
            ),
            "grouped": (
                unstructured,
                partial(
                    grouped_cpu_linear,
                    values=group_values,
                    group_masks=group_masks,
                    group_offsets=group_offsets,
                    in_features=columns,
                    out_features=rows,
                ),
            ),
        }
        for tokens in (1, 16, 17, 33, 128, 129, 300):
            x = torch.randint(-3, 4, (tokens, columns), generator=generator).to(torch.bfloat16)
            bias = torch.randint(-3, 4, (rows,), generator=generator).to(torch.bfloat16)
            for layout, (weight, run) in runs.items():
                for b in (bias, None):
                    exact = x.double() @ weight.double().t()
                    if b is not None:
                        exact = exact + b.double()
                    got = run(x, bias=b, thresholds=brgemm)
                    assert torch.equal(got, exact.to(torch.bfloat16)), (layout, rows, tokens)


def test_bitmask_op_refuses_bad_tensors():
    weight = integer_sparse(8, 64, 0.5, torch.float32, torch.Generator().manual_seed(5))
    values, bitmask, row_offsets = compress_bitmask(weight)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="row_offsets must be a contiguous"):
        bitmask_cpu_linear(x, values, bitmask, row_offsets.int(), None, 64)
    with pytest.raises(RuntimeError, match="values must be a contiguous 1-D"):
        bitmask_cpu_linear(x, values.reshape(1, -1), bitmask, row_offsets, None, 64)
    with pytest.raises(RuntimeError, match=r"x must be a CPU tensor \[\.\.\., 64\]"):
        bitmask_cpu_linear(torch.randn(2, 60), values, bitmask, row_offsets, None, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_unstructured_plan_is_measured_on_each_path_that_runs(dtype):
    """The plan of an unstructured layer times the row kernels, the tiles and, where it runs
    (``gemm_runs``), the unstructured GEMM against dense, on a random weight of that
    density."""
    from whisper_sparse.cpu.plans import measure_cpu_plan
    from whisper_sparse.cpu.served_layer import random_unstructured

    weight = random_unstructured(64, 256, dtype, 0.35)
    assert abs((weight != 0).float().mean().item() - 0.35) < 0.02
    plan, timings = measure_cpu_plan(16, 64, dtype, ladder=(1, 4), density=0.35)
    gemm = gemm_runs(dtype, dtype)
    assert [t["tokens"] for t in timings] == [1, 4]
    assert all(
        {"dense_s", "rows_s", "tiles_s"} <= t.keys() and ("gemm_s" in t) == gemm for t in timings
    )
    if not gemm:
        assert plan.gemm_from == NO_TILES


def test_an_unstructured_plan_times_the_rows_as_the_served_module_holds_them(monkeypatch):
    """Where the grouped layout does not run (float32 here), the plan times the op over the
    rows spread as the served layer holds them (``served_layer``, ``cpu.row_spread``), not
    over the format's rows back to back: 25 % of 4096 float32 inputs is 4 KiB a row."""
    from whisper_sparse.cpu import plans as cpu_plans
    from whisper_sparse.cpu import served_layer as served_module
    from whisper_sparse.format.bitmask import compress_bitmask

    seen = []

    def recording(x, values, bitmask, row_offsets, bias, in_features, thresholds):
        seen.append((values.numel(), row_offsets.clone()))
        return x.new_zeros(*x.shape[:-1], bitmask.shape[0])

    weight = served_module.random_unstructured(8, 4096, torch.float32, 0.25)
    monkeypatch.setattr(served_module, "bitmask_cpu_linear", recording)
    monkeypatch.setattr(
        served_module, "random_unstructured", lambda rows, columns, dtype, density: weight
    )
    cpu_plans.measure_cpu_plan(8, 4096, torch.float32, ladder=(1,), density=0.25)
    values, bitmask, row_offsets = compress_bitmask(weight)
    served = served_module.served_layer(values, bitmask, 4096, row_offsets, "layer")
    assert seen and served.compressed.numel() > values.numel()
    assert {numel for numel, _ in seen} == {served.compressed.numel()}
    assert all(torch.equal(offsets, served.row_offsets) for _, offsets in seen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_bitmask_linear_runs_the_op_on_its_plan(dtype, tmp_path, monkeypatch):
    """A served unstructured layer over a layer's stored tensors (int32 offsets, as the
    legacy format may hold, become int64) gives F.linear of the dense weight exactly on
    integer values, on the row kernels and on the tiles; a moved offset is refused naming
    the layer."""
    from whisper_sparse.cpu.linear import CpuSparseLinear
    from whisper_sparse.cpu.plans import CpuPlan
    from whisper_sparse.cpu.served_layer import served_layer
    from whisper_sparse.format.bits import CorruptCheckpointError

    generator = torch.Generator().manual_seed(6)
    weight = integer_sparse(24, 100, 0.65, dtype, generator)
    values, bitmask, row_offsets = compress_bitmask(weight)
    x = torch.randint(-3, 4, (5, 100), generator=generator).to(dtype)
    for tiled_from in (NO_TILES, 1):
        served = served_layer(values, bitmask, 100, row_offsets.int(), "layer")
        module = CpuSparseLinear.serving(served, CpuPlan(tiled_from=tiled_from))
        if hasattr(served, "row_offsets"):  # rows (the grouped layout has none)
            assert module.row_offsets.dtype == torch.int64
        assert module.density() == pytest.approx(values.numel() / 2400)
        assert torch.equal(module(x).float(), F.linear(x.float(), weight.float()).to(dtype).float())
    moved = row_offsets.clone()
    moved[3] += 1
    with pytest.raises(CorruptCheckpointError, match=r"layer.row_offsets\[3\]"):
        served_layer(values, bitmask, 100, moved, "layer")
