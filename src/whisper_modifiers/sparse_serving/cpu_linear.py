"""2:4 Linear layers that stay compressed on the CPU: ``CpuSparse24Linear`` runs the CPU op
(``cpu_op``) on a layer's ``compressed`` and ``bitmask`` tensors, on the paths of its
shape's measured plan (``cpu_plans``). The vLLM plugin holds one per 2:4 layer
(``vllm_layers``), and transformers' loader puts one in place of each 2:4 ``nn.Linear``
(``transformers_quantizer``). ``cpu_serving_kernel`` says whether a layer gets one here.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import torch

from whisper_modifiers.sparse_serving.cpu_op import (
    CPU_KERNEL_DTYPES,
    cpu_kernels_unavailable,
    sparse24_cpu_linear,
)
from whisper_modifiers.sparse_serving.cpu_plans import CpuPlan, cpu_plan
from whisper_modifiers.sparse_serving.format import check_compressed
from whisper_modifiers.sparse_serving.kernels import kernel_mode

__all__ = ["CpuSparse24Linear", "cpu_serving_kernel", "cpu_serving_refusal"]


class CpuSparse24Linear(torch.nn.Module):
    """A 2:4 Linear whose weight is its ``compressed`` values and ``bitmask`` (``format``'s
    layout, also the checkpoint's parameter names), run by the CPU op. ``shape`` is the
    checkpoint's ``[[out], [in]]``, kept so that the module loads and saves as the
    checkpoint stores the layer."""

    def __init__(self, out_features: int, in_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None,
                 plan: CpuPlan | None = None):  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.compressed = torch.nn.Parameter(
            torch.empty(out_features, in_features // 2, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.bitmask = torch.nn.Parameter(
            torch.empty(out_features, -(-in_features // 8), dtype=torch.uint8, device=device),
            requires_grad=False,
        )
        self.shape = torch.nn.Parameter(
            torch.tensor([[out_features], [in_features]], device=device), requires_grad=False
        )
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
        self.plan = plan

    @classmethod
    def from_compressed(cls, compressed: torch.Tensor, bitmask: torch.Tensor, in_features: int,
                        name: str = "weight", plan: CpuPlan | None = None):  # fmt: skip
        """A module over loaded tensors, after ``format.check_compressed`` (the op reads the
        kept values of 32 inputs at ``k / 2``: every group must mark exactly two)."""
        check_compressed(compressed, bitmask, (compressed.shape[0], in_features), name)
        module = cls(compressed.shape[0], in_features, dtype=compressed.dtype, device="meta",
                     plan=plan)  # fmt: skip
        module.compressed = torch.nn.Parameter(compressed.contiguous(), requires_grad=False)
        module.bitmask = torch.nn.Parameter(bitmask.contiguous(), requires_grad=False)
        module.shape = torch.nn.Parameter(torch.tensor([[compressed.shape[0]], [in_features]]),
                                          requires_grad=False)  # fmt: skip
        return module

    def plan_paths(self) -> CpuPlan:
        """The measured plan of this shape and dtype (``cpu_plans``), kept."""
        self.plan = cpu_plan(self.out_features, self.in_features, self.compressed.dtype)
        return self.plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + bias`` (vLLM passes the bias itself)."""
        plan = self.plan or self.plan_paths()
        return sparse24_cpu_linear(x, self.compressed, self.bitmask, bias, self.in_features,
                                   plan.tiled_from, plan.gemm_from)  # fmt: skip

    def extra_repr(self) -> str:
        paths = "paths not measured yet" if self.plan is None else self.plan.describe()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"compressed 2:4, {paths}")  # fmt: skip


def cpu_serving_refusal(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why 2:4 layers of ``dtype`` on ``device`` are not run by the CPU op here (None where
    they are, unless the plan says dense is faster; ``cpu_serving_kernel``)."""
    if kernel_mode() == "dense":
        return "the kernel mode is dense ($WHISPER_MODIFIERS_SPARSE24)"
    if torch.device(device).type != "cpu":
        return f"the weights are on {torch.device(device).type}, not the CPU"
    if dtype not in CPU_KERNEL_DTYPES:
        return f"the 2:4 CPU op takes float32 and bfloat16, not {str(dtype).split('.')[-1]}"
    return cpu_kernels_unavailable()


def cpu_serving_kernel(compressed: torch.Tensor, bitmask: torch.Tensor, in_features: int,
                       name: str = "weight") -> CpuSparse24Linear | None:  # fmt: skip
    """The op's module for a loaded 2:4 layer, or None where the layer runs dense: the
    kernel mode is ``dense``, the op cannot run here (``cpu_serving_refusal``), or, in the
    ``auto`` mode, the measured plan of its shape has the op slower than dense at one
    token. ``sparse`` runs the op wherever it can."""
    if cpu_serving_refusal(compressed.device, compressed.dtype) is not None:
        return None
    plan = cpu_plan(compressed.shape[0], in_features, compressed.dtype)
    if kernel_mode() == "auto" and not plan.faster_at_decode:
        return None
    return CpuSparse24Linear.from_compressed(compressed, bitmask, in_features, name, plan)
