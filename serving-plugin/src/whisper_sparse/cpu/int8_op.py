"""The W8A8 CPU op: a compressed-tensors W8A8 layer (int8 weights with a float32 scale per
output row, per-token dynamic symmetric int8 activations) served from its stored int8
values, 2:4 (``format.two_four``) or unstructured (``format.bitmask``), never holding the
dense int8 weight.

``y = x_scale * w_scale * (x_q . w_qᵀ) (+ b)``, scaled in the order of vLLM's oneDNN W8A8 layer
(``fma(sum * w_scale, x_scale, b)``, one rounding); the integer sums are exact, so the op equals
``reference_int8_linear`` (the dense int8 weight, an int64 product, the same scaling) bit for
bit on every kernel. ``quantize_per_token`` quantizes the activations exactly as vLLM's
``onednn_scaled_int8_quant`` does (``scale = amax / 127``, ``x_q = round(x * (1 / scale))``,
to nearest even), so that the output can equal vLLM's dense W8A8 layer on its oneDNN path.

The kernels (``kernels/int8_op.cpp``): AVX-512 VNNI row kernels (``vpexpandb`` places the kept
values, ``vpdpbusd`` sums the products), and from ``tiles_from`` tokens AMX-INT8 tiles where
they run (a block of int8 rows expanded once, every token multiplied through it).
``int8_kernels`` says which run here; below AVX-512 VNNI none does, and such layers are
served dense.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import torch

from whisper_sparse.cpu.op import _ops, cpu_kernels_unavailable

__all__ = [
    "INT8_KERNELS",
    "int8_cpu_linear",
    "int8_decompress_cpu",
    "int8_kernels",
    "quantize_per_token",
    "reference_int8_linear",
]

INT8_KERNELS = ("none", "avx512_vnni", "amx_int8")
NO_TILES = 1 << 62  # tiles_from that keeps every token count on the row kernels


def int8_kernels() -> str:
    """The W8A8 kernels that run here (``INT8_KERNELS``): ``"amx_int8"`` (the AMX-INT8 tiles
    and the VNNI row kernels), ``"avx512_vnni"`` (the row kernels) or ``"none"``."""
    return "none" if cpu_kernels_unavailable() else _ops().int8_kernels()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, scale)`` of ``x`` ``[..., K]``: int8 ``[M, K]`` and float32 ``[M, 1]``, as
    vLLM's ``onednn_scaled_int8_quant`` gives them (a token of zeros: scale 0, zeros)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    scale = rows.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    x_q = torch.round(rows * inverse).clamp_(-128, 127).to(torch.int8)
    return x_q, scale


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
) -> torch.Tensor:
    """The op on a W8A8 layer as stored: 2:4 (``values`` ``[out, in / 2]``) or unstructured
    (``values`` 1-D and ``row_offsets``), for activations already quantized per token."""
    return _ops().int8_linear(
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
    )


def int8_decompress_cpu(
    values: torch.Tensor,
    bitmask: torch.Tensor,
    in_features: int,
    row_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense int8 weight of a stored W8A8 layer, by the kernels' own expansion."""
    return _ops().int8_decompress(values, bitmask, row_offsets, in_features)


def reference_int8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """What the op computes, from the dense int8 weight: the exact integer products, then as
    vLLM's oneDNN W8A8 layer scales them, ``fma(float32(sum) * w_scale, x_scale, bias)``
    (the fused multiply-add in float64, where the product is exact), rounded to ``out_dtype``."""
    sums = (x_q.to(torch.int64) @ weight_q.to(torch.int64).t()).to(torch.float32)
    row_scaled = (sums * w_scale.reshape(1, -1).to(torch.float32)).to(torch.float64)
    y = row_scaled * x_scale.reshape(-1, 1).to(torch.float64)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32).to(out_dtype)
