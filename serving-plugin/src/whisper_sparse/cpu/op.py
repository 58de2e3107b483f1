"""The sparse CPU op: ``y = x Wᵀ (+ b)`` read from a layer's compressed tensors, never
holding the dense weight, over three layouts: 2:4 (``format.two_four``: ``compressed``
``[out, in / 2]``, ``bitmask`` ``[out, ceil(in / 8)]``), unstructured rows
(``format.bitmask``, ``bitmask_cpu_linear``) and the grouped layout (``cpu.grouped_layout``,
``grouped_cpu_linear``). ``cpu.served_layer`` builds the layout a layer is served in.

The ops (``kernels/op.cpp``, built and loaded by ``cpu.build``) take bfloat16 or float32
activations and weights, any number of tokens and any input size that is a multiple of 4,
on one of the ``PATHS`` by the number of tokens, as a ``PathThresholds`` says (a plan's,
``cpu.plans``):

* ``rows``, below ``gemm_from`` (decode, memory-bound): the row kernels expand the kept
  values in registers: AVX-512 expands (VBMI2), with AVX512_BF16's dot product for bfloat16,
  or a shuffle table on AVX2;
* ``gemm``, from ``gemm_from`` (batched decode, prefill), for bfloat16 on ``avx512_bf16``
  kernels (``gemm_runs``): the 2:4 GEMM multiplies the kept values only (per group of four
  inputs, ``vpermw`` picks the two inputs each row's two kept values belong to, then one
  ``vdpbf16ps``); an unstructured layer's GEMM expands a block of rows once per call into
  ``vdpbf16ps``'s layout and runs every token over it;
* ``lanes``, a 2:4 layer below ``lanes_until``: the unstructured GEMM over its rows;
* ``tiles``, from ``tiled_from``: about 1 MiB of weight rows expanded at a time and handed
  to ATen's dense GEMM (oneDNN: AMX where the CPU has it);
* ``brgemm``, the tiles below ``brgemm_until``: blocks expanded once through a
  micro-kernel, AMX tiles where AMX-BF16 runs, else oneDNN's (``brgemm_kernel``).

The kernels are chosen at run time from the CPU's flags (``cpu_isa``; ``set_cpu_isa``
caps them, for tests). ``reference_linear`` is the pure-torch reference the tests compare
the op with.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from whisper_sparse.cpu.build import CPU_OP_NAMESPACE, load_cpu_kernels
from whisper_sparse.format.two_four import decompress_24

__all__ = [
    "CPU_ISAS",
    "NO_TILES",
    "PATHS",
    "PathThresholds",
    "CPU_KERNEL_DTYPES",
    "cpu_isa",
    "cpu_kernels_unavailable",
    "bitmask_cpu_linear",
    "brgemm_kernel",
    "bitmask_decompress_cpu",
    "decompress_cpu",
    "gemm_runs",
    "grouped_cpu_linear",
    "grouped_decompress_cpu",
    "grouped_layout_runs",
    "reference_linear",
    "set_cpu_isa",
    "supported_isas",
    "two_four_cpu_linear",
]

CPU_ISAS = ("avx2", "avx512", "avx512_bf16")
"""The kernels' instruction sets, lowest first (``avx512``: F, BW, VL and VBMI2)."""
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
NO_TILES = 1 << 62  # a threshold no token count reaches
PATHS = ("rows", "gemm", "lanes", "tiles", "brgemm")


@dataclass(frozen=True, kw_only=True)
class PathThresholds:
    """Which of the ``PATHS`` the op takes at a token count (its fields in the op schema's
    order, ``kernels/op.cpp``): the row kernels below
    ``gemm_from``, the GEMM from it (a 2:4 layer's unstructured GEMM, "lanes", below
    ``lanes_until``), the tiles from ``tiled_from`` (through a micro-kernel below
    ``brgemm_until``: ``brgemm_kernel``). The default takes the row kernels at every count."""

    gemm_from: int = NO_TILES
    tiled_from: int = NO_TILES
    lanes_until: int = 0
    brgemm_until: int = 0

    @classmethod
    def only(cls, path: str) -> PathThresholds:
        """The thresholds that take ``path`` at every token count."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}, not {path!r}")
        return {
            "rows": cls(),
            "gemm": cls(gemm_from=0),
            "lanes": cls(gemm_from=0, lanes_until=NO_TILES),
            "tiles": cls(tiled_from=0),
            "brgemm": cls(tiled_from=0, brgemm_until=NO_TILES),
        }[path]

    def path(self, tokens: int) -> str:
        """The path the op takes for ``tokens`` tokens."""
        if tokens >= self.tiled_from:
            return "brgemm" if tokens < self.brgemm_until else "tiles"
        if tokens >= self.gemm_from:
            return "lanes" if tokens < self.lanes_until else "gemm"
        return "rows"


ROWS_ONLY = PathThresholds()


@functools.cache
def cpu_kernels_unavailable() -> str | None:
    """None where the op runs here, else why not, in one line (``cpu.build``)."""
    reason = load_cpu_kernels()
    if reason is None:
        _register_fake()
    return reason


def _ops():
    return getattr(torch.ops, CPU_OP_NAMESPACE)


_linear_overload = None


def _linear():
    """The ``linear`` op's overload, looked up once (a decode step calls it per layer; a
    global rather than ``functools.cache``, which torch.compile warns about)."""
    global _linear_overload
    if _linear_overload is None:
        _linear_overload = _ops().linear.default
    return _linear_overload


def _register_fake() -> None:
    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::linear")
    def _(
        x,
        compressed,
        bitmask,
        bias,
        in_features,
        gemm_from,
        tiled_from,
        lanes_until=0,
        brgemm_until=0,
    ):
        return x.new_empty(*x.shape[:-1], compressed.shape[0])

    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::decompress")
    def _(compressed, bitmask, in_features):
        return compressed.new_empty(compressed.shape[0], in_features)

    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::bitmask_linear")
    def _(
        x, values, bitmask, row_offsets, bias, in_features, gemm_from, tiled_from, brgemm_until=0
    ):
        return x.new_empty(*x.shape[:-1], bitmask.shape[0])

    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::bitmask_decompress")
    def _(values, bitmask, row_offsets, in_features):
        return values.new_empty(bitmask.shape[0], in_features)

    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::grouped_linear")
    def _(
        x,
        values,
        group_masks,
        group_offsets,
        bias,
        in_features,
        out_features,
        gemm_from,
        tiled_from,
        brgemm_until=0,
    ):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::grouped_decompress")
    def _(values, group_masks, group_offsets, in_features, out_features):
        return values.new_empty(out_features, in_features)

    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::int8_linear")
    def _(x_q, x_scale, values, bitmask, row_offsets, w_scale, bias, in_features, out_dtype, *_):
        return x_q.new_empty(*x_q.shape[:-1], bitmask.shape[0], dtype=out_dtype)

    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::int8_quantize")
    def _(x, rounding):
        rows = x.reshape(-1, x.shape[-1])
        return rows.new_empty(rows.shape, dtype=torch.int8), rows.new_empty(
            rows.shape[0], 1, dtype=torch.float32
        )

    @torch.library.register_fake(f"{CPU_OP_NAMESPACE}::int8_decompress")
    def _(values, bitmask, row_offsets, in_features):
        return values.new_empty(bitmask.shape[0], in_features)


def cpu_isa() -> str | None:
    """The kernels the op runs here (``CPU_ISAS``), None where it is unavailable."""
    return None if cpu_kernels_unavailable() else _ops().isa()


def supported_isas() -> list[str]:
    """Every ``CPU_ISAS`` entry this CPU runs, lowest first (empty without the op)."""
    best = cpu_isa()
    return [] if best is None else list(CPU_ISAS[: CPU_ISAS.index(best) + 1])


def set_cpu_isa(name: str) -> None:
    """Cap the kernels at ``name`` (one of ``supported_isas()``), or ``"auto"``."""
    if cpu_kernels_unavailable() is None:
        _ops().set_isa(name)


def brgemm_kernel() -> str:
    """Where the micro-kernel tiles (``brgemm_until``) run: ``"amx"`` (AMX tiles, the op's
    own, ``kernels/op_amx.cpp``), ``"avx512"`` (oneDNN's AVX512_BF16 micro-kernel) or
    ``"none"`` (the tiles call ATen's GEMM)."""
    return "none" if cpu_kernels_unavailable() else _ops().brgemm_kernel()


def gemm_runs(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """Whether the op's GEMMs (2:4 and unstructured) run ``x_dtype`` activations with
    ``weight_dtype`` weights here: bfloat16 both, on the ``avx512_bf16`` kernels (elsewhere
    the token counts given to them run the row kernels)."""
    return cpu_isa() == "avx512_bf16" and x_dtype == weight_dtype == torch.bfloat16


def grouped_layout_runs(weight_dtype: torch.dtype) -> bool:
    """Whether the op's served unstructured layers of ``weight_dtype`` are held in the grouped
    layout here (``cpu.grouped_layout``): bfloat16 on the ``avx512_bf16`` kernels, where its
    one-stream row kernel runs (bfloat16 activations; float32 ones take its tiles)."""
    return gemm_runs(weight_dtype, weight_dtype)


def two_four_cpu_linear(
    x: torch.Tensor,
    compressed: torch.Tensor,
    bitmask: torch.Tensor,
    bias: torch.Tensor | None,
    in_features: int,
    thresholds: PathThresholds = ROWS_ONLY,
) -> torch.Tensor:
    """``x Wᵀ + bias`` for the 2:4 ``W`` stored as ``compressed`` / ``bitmask``, on the path
    ``thresholds`` gives each token count (the GEMMs where they run: ``gemm_runs``; the
    micro-kernel where it runs: ``brgemm_kernel``)."""
    return _linear()(
        x,
        compressed,
        bitmask,
        bias,
        in_features,
        thresholds.gemm_from,
        thresholds.tiled_from,
        thresholds.lanes_until,
        thresholds.brgemm_until,
    )


def bitmask_cpu_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    bitmask: torch.Tensor,
    row_offsets: torch.Tensor,
    bias: torch.Tensor | None,
    in_features: int,
    thresholds: PathThresholds = ROWS_ONLY,
) -> torch.Tensor:
    """``x Wᵀ + bias`` for the unstructured ``W`` stored as ``values`` / ``bitmask`` /
    ``row_offsets`` (``format.bitmask``), as ``two_four_cpu_linear``'s (no lanes: its GEMM
    is the unstructured one)."""
    return _ops().bitmask_linear(
        x,
        values,
        bitmask,
        row_offsets,
        bias,
        in_features,
        thresholds.gemm_from,
        thresholds.tiled_from,
        thresholds.brgemm_until,
    )


def bitmask_decompress_cpu(
    values: torch.Tensor, bitmask: torch.Tensor, row_offsets: torch.Tensor, in_features: int
) -> torch.Tensor:
    """The dense unstructured ``W`` by the op's kernels (what its tiles hold)."""
    return _ops().bitmask_decompress(values, bitmask, row_offsets, in_features)


def grouped_cpu_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    group_masks: torch.Tensor,
    group_offsets: torch.Tensor,
    bias: torch.Tensor | None,
    in_features: int,
    out_features: int,
    thresholds: PathThresholds = ROWS_ONLY,
) -> torch.Tensor:
    """``x Wᵀ + bias`` for the unstructured ``W`` in the grouped layout (``cpu.grouped_layout``,
    bfloat16), as ``bitmask_cpu_linear``'s (its row kernel reads one stream per group), for
    bfloat16 ``x`` on the ``avx512_bf16`` kernels; elsewhere the tiles at every token
    count."""
    return _ops().grouped_linear(
        x,
        values,
        group_masks,
        group_offsets,
        bias,
        in_features,
        out_features,
        thresholds.gemm_from,
        thresholds.tiled_from,
        thresholds.brgemm_until,
    )


def grouped_decompress_cpu(
    values: torch.Tensor,
    group_masks: torch.Tensor,
    group_offsets: torch.Tensor,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    """The dense ``W`` of a grouped layer by the op's kernels (what its tiles hold)."""
    return _ops().grouped_decompress(values, group_masks, group_offsets, in_features, out_features)


def decompress_cpu(compressed: torch.Tensor, bitmask: torch.Tensor, in_features: int):
    """The dense ``W`` by the op's expand kernels (what its prefill tiles hold)."""
    return _ops().decompress(compressed, bitmask, in_features)


def reference_linear(
    x: torch.Tensor,
    compressed: torch.Tensor,
    bitmask: torch.Tensor,
    bias: torch.Tensor | None,
    in_features: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``format.two_four.decompress_24`` then ``F.linear``, in ``dtype`` (default: ``x``'s)."""
    dtype = dtype or x.dtype
    weight = decompress_24(compressed, bitmask, (compressed.shape[0], in_features))
    return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
