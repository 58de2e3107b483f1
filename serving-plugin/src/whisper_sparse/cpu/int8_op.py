"""The W8A8 CPU op: a compressed-tensors W8A8 layer (int8 weights with a float32 scale per
output row, per-token dynamic symmetric int8 activations) served from its stored int8
values, 2:4 (``format.two_four``) or unstructured (``format.bitmask``), never holding the
dense int8 weight.

``y = x_scale * w_scale * (x_q . w_qᵀ) (+ b)``. The integer sums are exact, so the only
roundings are the activations' quantization and the scaling, and the op takes them from the
vLLM dense W8A8 kernel the layer stands in for (``rounding``, one of ``ROUNDINGS``):

- ``"onednn"``, vLLM's oneDNN layer: ``scale = amax / 127``, ``x_q = round(x * (1 / scale))``;
  ``y = fma(sum * w_scale, x_scale, b)``;
- ``"sgl"``, vLLM's AMX kernel (``int8_scaled_mm_with_quant``, which vLLM takes on AMX CPUs):
  ``amax`` at least 1e-7, ``x_q = round(x * (127 / amax))``; ``y = fma(sum * x_scale, w_scale,
  b)``, or without a bias ``(sum * x_scale) * w_scale``.

Both round to nearest even. ``int8_quantize`` quantizes so, and the op then equals the dense
layer of its rounding bit for bit, as ``reference_int8_linear`` (the dense int8 weight, an int64
product, the same scaling) does on every kernel; ``quantize_per_token`` is the pure-torch
reference of the quantization.

The kernels (``kernels/int8_op.cpp``): AVX-512 VNNI row kernels (``vpermb`` places a 2:4
row's kept values, ``vpexpandb`` an unstructured row's, ``vpdpbusd`` sums the products), and
from ``tiles_from`` tokens AMX-INT8 tiles where they run, else AVX-512 VNNI tiles (a block of
int8 rows expanded once, every token multiplied through it); without
AVX-512 VNNI, 256-bit row kernels (a table's ``pshufb`` places the kept values): AVX-VNNI's
``vpdpbusd`` where the CPU has it, else AVX2's ``vpmaddwd`` on the products widened to int16
(exact, where ``vpmaddubsw`` would saturate), and from ``tiles_from`` tokens 256-bit tiles (a
block of rows expanded once to int16, the tokens widened once, ``vpmaddwd`` or AVX-VNNI's
``vpdpwssd``). ``int8_kernels`` says which run here, ``int8_paths`` which paths; below AVX2
none does, and such layers are served dense.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import torch

from whisper_sparse.cpu.op import _ops, cpu_kernels_unavailable

__all__ = [
    "INT8_KERNELS",
    "ROUNDINGS",
    "int8_cpu_linear",
    "int8_decompress_cpu",
    "int8_kernels",
    "int8_paths",
    "int8_quantize",
    "quantize_per_token",
    "reference_int8_linear",
    "scale_int8_sums",
]

INT8_KERNELS = ("none", "avx2", "avx_vnni", "avx512_vnni", "amx_int8")
ROUNDINGS = ("onednn", "sgl")
NO_TILES = 1 << 62  # tiles_from that keeps every token count on the row kernels


_loaded = False


def _int8_ops():
    """The op library, built and loaded once (else a RuntimeError saying why not)."""
    global _loaded
    if not _loaded:
        reason = cpu_kernels_unavailable()
        if reason is not None:
            raise RuntimeError(f"the W8A8 CPU op does not run here: {reason}")
        _loaded = True
    return _ops()


def int8_kernels() -> str:
    """The W8A8 kernels that run here (``INT8_KERNELS``): ``"amx_int8"`` (the AMX-INT8 tiles
    and the VNNI row kernels), ``"avx512_vnni"`` (the row kernels), ``"avx_vnni"`` (the
    256-bit VNNI row kernels), ``"avx2"`` (the exact AVX2 row kernels) or ``"none"``."""
    return "none" if cpu_kernels_unavailable() else _ops().int8_kernels()


def int8_paths() -> dict[str, int]:
    """The op's paths here, each with the ``tiles_from`` that takes it at every token count:
    ``rows``, and ``tiles`` where any kernels run (AMX-INT8's, AVX-512 VNNI's, or the 256-bit
    ones)."""
    tiles = int8_kernels() != "none"
    return {"rows": NO_TILES} | ({"tiles": 1} if tiles else {})


def check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return rounding


def quantize_per_token(x: torch.Tensor, rounding: str = "onednn"):
    """``(x_q, scale)`` of ``x`` ``[..., K]``: int8 ``[M, K]`` and float32 ``[M, 1]``, as the
    vLLM kernel of ``rounding`` quantizes it (the reference of ``int8_quantize``)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    amax = rows.abs().amax(dim=1, keepdim=True)
    if check_rounding(rounding) == "sgl":
        amax = amax.clamp_min(1e-7)
        scale, inverse = amax / 127, torch.full_like(amax, 127) / amax  # 127 / t: 127 * (1 / t)
    else:  # a token of zeros: scale 0, zeros
        scale = amax / 127
        inverse = torch.where(scale > 0, (1 / scale.double()).float(), torch.zeros_like(scale))
    x_q = torch.round(rows * inverse).clamp_(-128, 127).to(torch.int8)
    return x_q, scale


def int8_quantize(x: torch.Tensor, rounding: str = "onednn"):
    """``quantize_per_token`` by the op's kernel (bfloat16 or float32 ``x``)."""
    return _int8_ops().int8_quantize(x, check_rounding(rounding))


def int8_cpu_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    values: torch.Tensor,
    bitmask: torch.Tensor,
    w_scale: torch.Tensor,
    in_features: int,
    row_offsets: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    tiles_from: int = NO_TILES,
    rounding: str = "onednn",
) -> torch.Tensor:
    """The op on a W8A8 layer as stored: 2:4 (``values`` ``[out, in / 2]``) or unstructured
    (``values`` 1-D and ``row_offsets``), for activations already quantized per token, scaled
    in the order of ``rounding``'s kernel."""
    return _int8_ops().int8_linear(
        x_q,
        x_scale,
        values,
        bitmask,
        row_offsets,
        w_scale,
        bias,
        in_features,
        out_dtype,
        min(tiles_from, NO_TILES),
        check_rounding(rounding),
    )


def int8_decompress_cpu(
    values: torch.Tensor,
    bitmask: torch.Tensor,
    in_features: int,
    row_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense int8 weight of a stored W8A8 layer, by the kernels' own expansion."""
    return _int8_ops().int8_decompress(values, bitmask, row_offsets, in_features)


def reference_int8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    rounding: str = "onednn",
) -> torch.Tensor:
    """What the op computes, from the dense int8 weight: the exact integer products, then
    scaled as ``rounding``'s kernel scales them (``scale_int8_sums``)."""
    sums = (x_q.to(torch.int64) @ weight_q.to(torch.int64).t()).to(torch.float32)
    return scale_int8_sums(sums, x_scale, w_scale, bias, out_dtype, rounding)


def scale_int8_sums(
    sums: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    rounding: str = "onednn",
) -> torch.Tensor:
    """Integer sums ``[M, N]`` (as float32) scaled in the order of ``rounding``'s kernel, a
    bias added by a fused multiply-add (in float64, where the product of two float32 is
    exact), rounded to ``out_dtype``."""
    rows, tokens = w_scale.reshape(1, -1).to(torch.float32), x_scale.reshape(-1, 1).float()
    first, second = (tokens, rows) if check_rounding(rounding) == "sgl" else (rows, tokens)
    scaled = sums * first
    if bias is None:
        y = scaled * second
    else:
        y = (scaled.double() * second.double() + bias.double()).float()
    return y.to(out_dtype)
