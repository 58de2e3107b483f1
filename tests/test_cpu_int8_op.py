"""The W8A8 CPU op (``cpu.int8_op``) against its integer reference: the dense int8 weight, an
int64 product, the same scaling in either rounding. The sums are exact, so equality is the test
on every kernel this CPU runs (the row kernels and the 256-bit tiles; the AMX-INT8 tiles on AMX
machines, skipped elsewhere with the reason); the op's quantization against its torch
reference, and both against vLLM's own dense W8A8 kernels where vLLM is installed."""

from __future__ import annotations

import itertools
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import run_emulated_kernel_check
from whisper_sparse.cpu.build import SOURCE_DIR
from whisper_sparse.cpu.cpu_info import cpu_flag_set
from whisper_sparse.cpu.int8_op import (
    ROUNDINGS,
    int8_cpu_linear,
    int8_decompress_cpu,
    int8_kernels,
    int8_quantize,
    quantize_per_token,
    reference_int8_linear,
)
from whisper_sparse.cpu.op import cpu_kernels_unavailable
from whisper_sparse.format.bitmask import compress_bitmask
from whisper_sparse.format.two_four import compress_24

KERNELS = int8_kernels()
needs_int8_kernels = pytest.mark.skipif(
    KERNELS == "none", reason=f"no W8A8 CPU kernel runs here (int8_kernels: {KERNELS})"
)
needs_amx = pytest.mark.skipif(
    KERNELS != "amx_int8", reason=f"this CPU runs no AMX-INT8 tiles (int8_kernels: {KERNELS})"
)
# (out, in): inputs off the kernels' 64 and 4 (tails), rows off the tiles' 16 and 32 and the
# row kernels' 4, a 7B-like input size
SHAPES = [(5, 12), (7, 30), (33, 100), (64, 132), (97, 1000), (300, 4100), (16, 4096)]


def int8_weight(rows, columns, sparsity, generator, two_four=False):
    """Random int8 values, -128 and 127 included, pruned 2:4 or at ``sparsity``; one row all
    zeros and (unstructured) one row full."""
    weight = torch.randint(-128, 128, (rows, columns), generator=generator, dtype=torch.int16)
    if two_four:
        groups = weight.reshape(rows, -1, 4)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        chosen = torch.rand(groups.shape, generator=generator).topk(2, dim=-1).indices
        keep.scatter_(-1, chosen, True)
        weight = (groups * keep).reshape(rows, columns)
    else:
        weight = weight * (torch.rand(rows, columns, generator=generator) >= sparsity)
        if rows > 1:
            weight[1] = torch.randint(1, 128, (columns,), generator=generator)
    weight[0] = 0
    return weight.to(torch.int8)


def stored(weight, two_four):
    """The op's arguments for the layer as stored."""
    if two_four:
        values, bitmask = compress_24(weight)
        return {"values": values, "bitmask": bitmask}
    values, bitmask, offsets = compress_bitmask(weight)
    return {"values": values, "bitmask": bitmask, "row_offsets": offsets}


def tokens_q(count, columns, generator):
    """Quantized tokens holding -128 and 127, and their scales (one token all zeros)."""
    x_q = torch.randint(-128, 128, (count, columns), generator=generator).to(torch.int8)
    x_q[:, 0] = -128
    x_q[:, -1] = 127
    if count > 2:
        x_q[2] = 0
    scale = torch.rand(count, 1, generator=generator) * 0.01 + 1e-4
    return x_q, scale


def each_int8_kernel_set():
    """Cap the kernels at each ``supported_isas`` level whose W8A8 kernels differ from the
    last (AVX2's, then AVX-512 VNNI's), yielding their ``int8_kernels`` name; uncapped after."""
    from whisper_sparse.cpu.op import set_cpu_isa, supported_isas

    seen = set()
    try:
        for isa in supported_isas():
            set_cpu_isa(isa)
            kernels = int8_kernels()
            if kernels != "none" and kernels not in seen:
                seen.add(kernels)
                yield kernels
    finally:
        set_cpu_isa("auto")


def check_exact(layout, tiles_from, tokens_list, generator):
    for rows, columns in SHAPES:
        two_four = layout == "2:4"
        if two_four and columns % 4:
            continue
        for sparsity in (0.0, 0.5, 0.95) if not two_four else (None,):
            weight = int8_weight(rows, columns, sparsity, generator, two_four)
            parts = stored(weight, two_four)
            w_scale = torch.rand(rows, generator=generator) * 0.01 + 1e-4
            bias = torch.randn(rows, generator=generator)
            for count in tokens_list:
                x_q, x_scale = tokens_q(count, columns, generator)
                for b, out_dtype, rounding in itertools.product(
                    (None, bias), (torch.bfloat16, torch.float32), ROUNDINGS
                ):
                    got = int8_cpu_linear(
                        x_q,
                        x_scale,
                        **parts,
                        w_scale=w_scale,
                        in_features=columns,
                        bias=b,
                        out_dtype=out_dtype,
                        tiles_from=tiles_from,
                        rounding=rounding,
                    )
                    want = reference_int8_linear(
                        x_q, x_scale, weight, w_scale, b, out_dtype, rounding
                    )
                    assert torch.equal(got, want), (
                        layout,
                        rows,
                        columns,
                        sparsity,
                        count,
                        rounding,
                    )


@needs_int8_kernels
@pytest.mark.parametrize("layout", ["2:4", "unstructured"])
def test_int8_rows_are_exact_against_the_integer_reference(layout):
    """On every W8A8 row kernel set this CPU runs: the 256-bit rows (AVX-VNNI's where the CPU
    has it, else AVX2's), and AVX-512 VNNI's where it has that."""
    ran = []
    for kernels in each_int8_kernel_set():
        check_exact(layout, 1 << 40, (1, 2, 3, 4, 5, 9, 17), torch.Generator().manual_seed(1))
        ran.append(kernels)
    assert ran[0] in ("avx2", "avx_vnni"), ran


@needs_amx
@pytest.mark.parametrize("layout", ["2:4", "unstructured"])
def test_amx_int8_tiles_are_exact_against_the_integer_reference(layout):
    """Both block sizes (up to 128 tokens, and above) and passes over K (4100 inputs)."""
    check_exact(layout, 1, (1, 16, 17, 33, 128, 129, 300), torch.Generator().manual_seed(2))


@needs_int8_kernels
@pytest.mark.parametrize("layout", ["2:4", "unstructured"])
def test_256_bit_int8_tiles_are_exact_against_the_integer_reference(layout):
    """On the 256-bit kernel set this CPU runs (capped to it on AVX-512 VNNI CPUs): blocks of
    rows (300 of them) and passes over K (4100 inputs), token counts off the tiles' three."""
    ran = []
    for kernels in each_int8_kernel_set():
        if kernels in ("avx2", "avx_vnni"):
            check_exact(layout, 1, (1, 4, 5, 50), torch.Generator().manual_seed(3))
            ran.append(kernels)
    assert ran, "no 256-bit W8A8 kernel set ran"


@needs_int8_kernels
@pytest.mark.parametrize("layout", ["2:4", "unstructured"])
def test_int8_decompress_equals_the_stored_weight(layout):
    generator = torch.Generator().manual_seed(3)
    for kernels in each_int8_kernel_set():
        for rows, columns in SHAPES:
            if layout == "2:4" and columns % 4:
                continue
            weight = int8_weight(rows, columns, 0.6, generator, layout == "2:4")
            parts = stored(weight, layout == "2:4")
            got = int8_decompress_cpu(
                parts["values"], parts["bitmask"], columns, parts.get("row_offsets")
            )
            assert torch.equal(got, weight), (kernels, layout, rows, columns)


@needs_int8_kernels
def test_int8_op_keeps_leading_dimensions_and_refuses_bad_tensors():
    generator = torch.Generator().manual_seed(4)
    weight = int8_weight(8, 64, None, generator, two_four=True)
    parts = stored(weight, True)
    w_scale = torch.ones(8)
    x_q, x_scale = tokens_q(6, 64, generator)
    got = int8_cpu_linear(x_q.reshape(2, 3, 64), x_scale, **parts, w_scale=w_scale, in_features=64)
    assert got.shape == (2, 3, 8)
    with pytest.raises(RuntimeError, match="x_scale must hold one scale per token"):
        int8_cpu_linear(x_q, x_scale[:3], **parts, w_scale=w_scale, in_features=64)
    with pytest.raises(RuntimeError, match="w_scale must hold one scale per output row"):
        int8_cpu_linear(x_q, x_scale, **parts, w_scale=torch.ones(3), in_features=64)
    with pytest.raises(RuntimeError, match="values must be a contiguous int8 tensor"):
        int8_cpu_linear(x_q, x_scale, parts["values"].float(), parts["bitmask"], w_scale, 64)
    with pytest.raises(RuntimeError, match="x_q must be an int8 CPU tensor"):
        int8_cpu_linear(x_q.float(), x_scale, **parts, w_scale=w_scale, in_features=64)


def test_quantize_per_token_rounds_to_nearest_even_with_scale_amax_over_127():
    """``scale = amax / 127`` and ``x_q = round(x * (1 / scale))`` (onednn) or
    ``round(x * (127 / amax))`` (sgl), ties to even: with amax 127 the scale is 1, so x's halves
    show the rounding; a token of zeros gives zeros, with scale 0 (onednn) or 1e-7 / 127 (sgl,
    its amax at least 1e-7)."""
    x = torch.tensor(
        [[127.0, -127.0, 2.5, 3.5, -2.5, -3.5, 0.49, 126.5], [0.0] * 8, [1.0, -0.5] + [0.0] * 6]
    )
    for rounding, zero_scale in (("onednn", 0.0), ("sgl", 1e-7)):
        x_q, scale = quantize_per_token(x.to(torch.bfloat16), rounding)
        assert torch.equal(scale.flatten(), torch.tensor([127.0, zero_scale, 1.0]) / 127)
        assert x_q[0].tolist() == [127, -127, 2, 4, -2, -4, 0, 126]
        assert x_q[1].tolist() == [0] * 8
        assert x_q[2, :2].tolist() == [127, -64]  # -0.5 * 127 = -63.5: to even
    with pytest.raises(ValueError, match="rounding must be one of"):
        quantize_per_token(x, "nearest")


def test_the_two_roundings_part_where_their_inverses_do():
    """The roundings differ in the inverse of the scale: for amax 9.1875, ``1 / (amax / 127)``
    rounds below ``127 / amax``, so amax / 2 (63.5 exactly) rounds down to 63 on the one and
    up to the even 64 on the other."""
    x = torch.tensor([[9.1875, 4.59375, -4.59375, 1.0]], dtype=torch.bfloat16)
    assert quantize_per_token(x, "onednn")[0].tolist() == [[127, 63, -63, 14]]
    assert quantize_per_token(x, "sgl")[0].tolist() == [[127, 64, -64, 14]]


@pytest.mark.skipif(cpu_kernels_unavailable() is not None, reason=f"{cpu_kernels_unavailable()}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_quantize_is_its_torch_reference_bit_for_bit(dtype):
    """The op's quantizer against ``quantize_per_token`` in both roundings, compiled for every
    kernel set this CPU runs (capped below AVX-512 VNNI: the portable build): tails off every
    vector width, ties, amax at -x and +x, tokens of zeros, large and tiny scales."""
    from whisper_sparse.cpu.op import set_cpu_isa, supported_isas

    try:
        for isa in supported_isas():
            set_cpu_isa(isa)
            check_quantize(dtype, torch.Generator().manual_seed(7))
    finally:
        set_cpu_isa("auto")
    with pytest.raises(ValueError, match="rounding must be one of"):
        int8_quantize(torch.ones(2, 3), "amx")


def check_quantize(dtype, generator):
    for tokens, columns in ((1, 1), (3, 7), (17, 100), (64, 576), (5, 4100)):
        x = torch.randn(tokens, columns, generator=generator)
        x = x * torch.logspace(-6, 4, tokens).reshape(-1, 1)
        x[0, 0] = -x.abs().max() * 2
        if tokens > 2:
            x[2] = 0
            x[1, : min(columns, 4)] = torch.tensor([127.0, 0.5, 1.5, -62.5])[: min(columns, 4)]
        x = x.to(dtype)
        for rounding in ROUNDINGS:
            got_q, got_scale = int8_quantize(x.reshape(1, tokens, columns), rounding)
            want_q, want_scale = quantize_per_token(x, rounding)
            assert torch.equal(got_scale, want_scale), (tokens, columns, rounding)
            assert torch.equal(got_q, want_q), (tokens, columns, rounding)


VLLM_CHECK = """
import torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform

current_platform.import_kernels()
if not getattr(ops, "_supports_onednn", False):
    print("SKIP this vLLM build has no oneDNN W8A8 layer")
    raise SystemExit
from whisper_sparse.cpu.op import cpu_kernels_unavailable

assert cpu_kernels_unavailable() is None, cpu_kernels_unavailable()
from whisper_sparse.cpu.int8 import ExactInt8Linear, onednn_int8_saturates
from whisper_sparse.cpu.int8_op import int8_cpu_linear, int8_kernels, int8_paths, int8_quantize
from whisper_sparse.format.bitmask import compress_bitmask
from whisper_sparse.format.two_four import compress_24
from whisper_sparse.vllm_adapter.w8a8 import dense_w8a8_linear, vllm_w8a8_rounding

g = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):  # the quantization, ties and a token of zeros
    x = (torch.randn(37, 4100, generator=g) * 3).to(dtype)
    x[3] = 0
    x[4, :8] = torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 63.5])
    x_q, scale = int8_quantize(x, "onednn")
    want_q, want_scale, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    assert torch.equal(scale, want_scale.float().reshape(-1, 1)), dtype
    # a token of zeros (scale 0): vLLM's AVX2 build gives -128s (0 * inf), its AVX-512 one
    # zeros as ours; every output of such a token is 0 either way (checked below)
    tokens = scale.flatten() > 0
    assert torch.equal(x_q[tokens], want_q[tokens]), dtype
    assert not x_q[~tokens].any(), dtype
paths = int8_paths()
rows, columns = 768, 1024
weight = torch.randint(-127, 128, (rows, columns), dtype=torch.int8, generator=g)
groups = weight.reshape(rows, -1, 4)
keep = torch.zeros_like(groups, dtype=torch.bool)
keep.scatter_(-1, groups.to(torch.int16).abs().topk(2, dim=-1).indices, True)
layouts = {
    "2:4": (groups * keep).reshape(rows, columns),
    "65 %": weight * (torch.rand(rows, columns, generator=g) >= 0.65),
}
scales = torch.rand(rows, 1, generator=g) * 1e-3 + 1e-4
bias = torch.randn(rows, generator=g).to(torch.bfloat16)


def onednn_layer(dense):  # vLLM's oneDNN W8A8 layer, or where it saturates its exact stand-in
    if onednn_int8_saturates():
        exact = ExactInt8Linear(dense, scales, [rows])
        return lambda x, b: exact(x, b)
    handle = ops.create_onednn_scaled_mm(dense.t(), scales, torch.bfloat16, True, False, 32)

    def run(x, b):
        x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
        want = torch.empty(x.shape[0], rows, dtype=torch.bfloat16)
        ops.onednn_scaled_mm(handle, x_q, want, x_s, None, None, b)
        return want

    return run


def sgl_layer(dense):  # vLLM's AMX W8A8 kernel, its bias in float32 as vLLM's layer keeps it
    packed = torch.ops._C.convert_weight_packed(dense)

    def run(x, b):
        b32 = None if b is None else b.float()
        return torch.ops._C.int8_scaled_mm_with_quant(x, packed, scales, b32, x.dtype, True)

    return run


kernels = {"onednn": onednn_layer}
if vllm_w8a8_rounding(rows, columns) == "sgl":  # vLLM's own choice for the shape here
    kernels["sgl"] = sgl_layer
    assert dense_w8a8_linear(layouts["2:4"], scales).path.startswith("int8_scaled_mm")
for layout, dense in layouts.items():
    if layout == "2:4":
        values, bitmask = compress_24(dense)
        offsets = None
    else:
        values, bitmask, offsets = compress_bitmask(dense)
    for rounding, make in kernels.items():
        vllm_layer = make(dense)
        for b in (None, bias):
            for tokens in (1, 5, 64, 300):
                x = (torch.randn(tokens, columns, generator=g) * 2).to(torch.bfloat16)
                x[tokens // 2] = 0
                want = vllm_layer(x, b)
                x_q, x_s = int8_quantize(x, rounding)
                for path, tiles_from in paths.items():
                    got = int8_cpu_linear(
                        x_q, x_s, values, bitmask, scales.reshape(-1), columns, offsets, b,
                        torch.bfloat16, tiles_from, rounding,
                    )
                    assert torch.equal(got, want), (layout, rounding, b is not None, tokens, path)
print("OK", int8_kernels(), sorted(paths), sorted(kernels), "saturates", onednn_int8_saturates())
"""


@needs_int8_kernels
def test_the_op_is_vllms_dense_w8a8_layers_bit_for_bit():
    """In the serving environment: ``int8_quantize`` is vLLM's ``onednn_scaled_int8_quant``
    (ties, -128 and 127, a token of zeros), and the op on a 2:4 and a 65 % layer as stored
    equals vLLM's oneDNN W8A8 layer (``onednn_scaled_mm``) on the same weight served dense, with
    and without a bias, on every path that runs here; where that GEMM saturates (CPUs without
    VNNI), it equals the dense layer served instead, ``ExactInt8Linear``. Where vLLM takes its
    AMX kernel for the shape (``int8_scaled_mm_with_quant``, on AMX CPUs), the op in that
    kernel's rounding equals it too (quantization included), and elsewhere that half is left
    out."""
    from whisper_sparse.driver.worker_process import serving_python

    try:
        python = serving_python()
    except FileNotFoundError as error:  # no serving environment: scripts/setup_serving.sh
        pytest.skip(str(error))
    done = subprocess.run(
        [str(python), "-c", VLLM_CHECK], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    if last.startswith("SKIP"):
        pytest.skip(last[5:])
    assert last.startswith("OK"), last
    print(last)


VNNI_SOURCES = ("int8_avx512_vnni.cpp", "int8_avx512_vnni_tiles.cpp")
VNNI_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_vbmi2", "avx512_vnni"}


@pytest.mark.parametrize("emulated", [True, False], ids=["emulated", "native"])
def test_int8_kernels_are_right_on_any_cpu(tmp_path, emulated):
    """The VNNI rows and tiles compiled with tests/native/avx512_emulation.h (vpexpandb,
    vpermb, vpdpbusd and the rest lane by lane, as Intel's manual defines them) against a
    scalar reference, so their masks, tails, the tiles' blocks and passes and the unsigned
    shift are checked on CPUs without VNNI too; and built for this CPU where it has them.
    Under AddressSanitizer, so a load past a layer's values fails."""
    missing = VNNI_FLAGS - cpu_flag_set()
    if not emulated and missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    native = Path(__file__).with_name("native")
    sources = [native / "check_int8_kernels.cpp", *(SOURCE_DIR / f for f in VNNI_SOURCES)]
    run_emulated_kernel_check(tmp_path, sources, emulated=emulated)


AVX_256_CHECKS = {  # the 256-bit kernels' native checks: their files and -D arguments
    "avx2": (["int8_avx2.cpp"], ("WS_INT8_AVX2",)),
    "avx_vnni emulated": (
        ["int8_avx2.cpp", "int8_avx_vnni.cpp"],
        ("WS_INT8_AVX_VNNI", 'WS_EMULATE_AVX_VNNI="avx_vnni_emulation.h"'),
    ),
    "avx_vnni": (["int8_avx2.cpp", "int8_avx_vnni.cpp"], ("WS_INT8_AVX_VNNI",)),
}


@pytest.mark.parametrize("kernels", list(AVX_256_CHECKS))
def test_256_bit_int8_kernels_are_exact_under_address_sanitizer(tmp_path, kernels):
    """The AVX2 and AVX-VNNI kernels, built for this CPU (AVX-VNNI's vpdpbusd also from
    tests/native/avx_vnni_emulation.h, so the shift and its correction are checked without
    AVX-VNNI), against the same scalar reference: their table expansion, tails off 16 and 32
    inputs, and the copy that keeps an unstructured row's last loads inside its values
    (AddressSanitizer fails a load past them)."""
    flags = cpu_flag_set()
    if "avx2" not in flags or (kernels == "avx_vnni" and "avx_vnni" not in flags):
        pytest.skip(f"this CPU does not run the {kernels.split()[0]} instructions")
    files, defines = AVX_256_CHECKS[kernels]
    native = Path(__file__).with_name("native")
    sources = [native / "check_int8_kernels.cpp", *(SOURCE_DIR / f for f in files)]
    run_emulated_kernel_check(tmp_path, sources, emulated=False, defines=defines)


def test_an_int8_plan_takes_the_tiles_from_where_they_never_lost_to_the_rows():
    """The tiles from the lowest count at and above which they never lost to the rows (a
    win at 4 tokens followed by a loss at 16 does not count); the op against dense at each
    count on its chosen path; ``faster_at_decode`` from one token."""
    from whisper_sparse.cpu.int8_serving import int8_plan_from_timings

    def point(tokens, dense, rows, tiles):
        return {"tokens": tokens, "dense_s": dense, "rows_s": rows, "tiles_s": tiles}

    timings = [point(1, 2.0, 1.0, 3.0), point(4, 2.0, 2.0, 1.0), point(16, 2.0, 1.0, 1.5)]
    timings += [point(64, 4.0, 5.0, 2.0), point(512, 8.0, 30.0, 10.0)]
    plan = int8_plan_from_timings(timings)
    assert plan.tiled_from == 64 and plan.path(16) == "rows" and plan.path(64) == "tiles"
    assert plan.faster_at_decode
    assert plan.speedups == ((1, 2.0), (4, 1.0), (16, 2.0), (64, 2.0), (512, 0.8))
    assert "rows from 1; tiles from 64 tokens" in plan.describe()
    no_tiles = [{k: v for k, v in t.items() if k != "tiles_s"} | {"dense_s": 0.5} for t in timings]
    plan = int8_plan_from_timings(no_tiles)
    assert plan.path(512) == "rows" and not plan.faster_at_decode


@needs_int8_kernels
@pytest.mark.parametrize("mode", ["auto", "sparse", "dense"])
def test_a_served_int8_layer_runs_the_op_on_its_measured_plan(tmp_path, monkeypatch, mode):
    """``int8_serving_kernel`` measures the plan against the given dense layer (a stand-in
    always slower, so ``auto`` keeps the op) and caches it, expands a scale per fused part to
    rows, and its layer computes the reference in the rounding it was given; in the ``dense``
    mode there is none."""
    from whisper_sparse.cpu import plans as cpu_plans
    from whisper_sparse.cpu.int8_serving import int8_serving_kernel

    monkeypatch.setenv("WHISPER_MODIFIERS_CACHE", str(tmp_path))
    monkeypatch.setenv("WHISPER_MODIFIERS_SPARSE", mode)
    monkeypatch.setattr(cpu_plans, "_known", {})
    made = []

    def dense_for(weight, scales):
        made.append(weight.shape)

        def run(x):  # a dense layer 2 ms slower than any op call on this tiny layer
            time.sleep(0.002)
            return x

        return run

    generator = torch.Generator().manual_seed(6)
    weight = int8_weight(96, 256, None, generator, two_four=True)
    parts = stored(weight, True)
    stored_parts = (parts["values"], parts["bitmask"], None)
    scale = torch.tensor([[0.01], [0.02]])  # per fused part: 32 and 64 rows
    layer = int8_serving_kernel(stored_parts, scale, [32, 64], 256, dense_for, "sgl")
    if mode == "dense":
        assert layer is None and not made
        return
    assert made == [torch.Size([96, 256])]
    assert layer.plan is not None and (mode == "sparse" or layer.plan.faster_at_decode)
    x = torch.randn(3, 5, 256, generator=generator).to(torch.bfloat16)
    x_q, x_scale = quantize_per_token(x, "sgl")
    rows_scale = torch.cat([torch.full((32,), 0.01), torch.full((64,), 0.02)])
    want = reference_int8_linear(x_q, x_scale, weight, rows_scale, None, torch.bfloat16, "sgl")
    assert torch.equal(layer.linear(x), want.reshape(3, 5, 96))
    monkeypatch.setattr(cpu_plans, "_known", {})  # a new process: the plan from the file
    again = int8_serving_kernel(stored_parts, scale, [32, 64], 256, dense_for, "sgl")
    assert again.plan == layer.plan
    assert len(made) == 1
