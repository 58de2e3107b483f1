"""W8A8 layers in vLLM on a CPU: the dense W8A8 layer as it is served here
(``dense_w8a8_linear``: vLLM's own, or ``cpu.int8.ExactInt8Linear`` where vLLM's saturates;
the baseline the W8A8 op's plans are measured against, and the benchmarks'), which of vLLM's
kernels a shape takes (``vllm_w8a8_rounding``: the op rounds as that one does), and a loaded
layer's W8A8 op (``w8a8_op_layer``, ``cpu.int8_serving``) where its plan says so.

Imports vLLM at import time: only ``vllm_adapter.layers`` and the benchmarks import it.
"""

from __future__ import annotations

import torch
import vllm._custom_ops as ops
from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

from whisper_sparse.cpu.int8 import ExactInt8Linear, onednn_int8_saturates
from whisper_sparse.cpu.int8_serving import int8_serving_kernel

__all__ = [
    "EXACT_PATH",
    "ONEDNN_PATH",
    "SGL_PATH",
    "dense_w8a8_linear",
    "vllm_w8a8_rounding",
    "w8a8_op_layer",
]

SGL_PATH = "int8_scaled_mm_with_quant (AMX)"
ONEDNN_PATH = "onednn_scaled_int8_quant + onednn_scaled_mm"
EXACT_PATH = "ExactInt8Linear (float32 GEMM: oneDNN's int8 GEMM saturates here)"


def vllm_w8a8_rounding(rows: int, columns: int) -> str:
    """The kernel vLLM's CPU W8A8 layer (``CPUInt8ScaledMMLinearKernel``, per-token symmetric
    activations) takes for an int8 weight ``[rows, columns]``: ``"sgl"``, its AMX kernel,
    where that takes the shape, else ``"onednn"`` (``cpu.int8_op.ROUNDINGS``)."""
    return "sgl" if check_cpu_sgl_kernel(rows, columns, torch.int8) else "onednn"


def dense_w8a8_linear(weight: torch.Tensor, scales: torch.Tensor):
    """``x -> y`` for an int8 ``weight`` ``[out, in]`` and its ``scales`` ``[out, 1]`` as a
    dense W8A8 layer is served here: vLLM's CPU W8A8 layer (``vllm_w8a8_rounding``'s kernel),
    or where its oneDNN GEMM saturates the plugin's ``ExactInt8Linear``; the function's
    ``path`` names the kernel."""
    rows, columns = weight.shape
    if onednn_int8_saturates():
        exact = ExactInt8Linear(weight, scales, [rows])

        def run_exact(x):
            return exact(x)

        run_exact.path = EXACT_PATH
        return run_exact
    if vllm_w8a8_rounding(rows, columns) == "sgl":
        packed = torch.ops._C.convert_weight_packed(weight)

        def run_sgl(x):
            return torch.ops._C.int8_scaled_mm_with_quant(x, packed, scales, None, x.dtype, True)

        run_sgl.path = SGL_PATH
        return run_sgl
    handle = ops.create_onednn_scaled_mm(weight.t(), scales, torch.bfloat16, True, False, 32)

    def run(x):
        x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty((x.shape[0], rows), dtype=x.dtype)
        ops.onednn_scaled_mm(handle, x_q, out, x_s, x_zp, None, None)
        return out

    run.kept = (weight, scales)  # the handle reads the scales in place, as vLLM's layer keeps them
    run.path = ONEDNN_PATH
    return run


def is_dynamic_w8a8(layer) -> bool:
    """A layer whose scheme quantizes the activations per token, dynamically and symmetrically
    (the W8A8 chains'), the only one the W8A8 op computes as vLLM does."""
    scheme = getattr(layer, "scheme", None)
    return getattr(scheme, "input_symmetric", False) and not getattr(
        scheme, "is_static_input_scheme", True
    )


def w8a8_op_layer(layer, stored):
    """The W8A8 op's layer for a loaded compressed W8A8 layer (``stored``: this rank's
    ``(values, bitmask, row_offsets)``), or None where it runs as vLLM's dense int8 layer."""
    if not is_dynamic_w8a8(layer):
        return None
    widths = list(getattr(layer, "logical_widths", None) or [stored[1].shape[0]])
    rows, columns = layer.sparse_dense_shape
    rounding = vllm_w8a8_rounding(rows, columns)
    return int8_serving_kernel(
        stored, layer.weight_scale.data, widths, columns, dense_w8a8_linear, rounding
    )
