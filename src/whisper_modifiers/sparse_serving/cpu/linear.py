"""Linear layers that stay compressed on the CPU and run the CPU op (``cpu.op``) on the
paths of their measured plan (``cpu.plans``): ``CpuSparse24Linear`` over a 2:4 layer's
``compressed`` and ``bitmask`` tensors, ``CpuBitmaskLinear`` over an unstructured layer's
``compressed`` values, ``bitmask`` and ``row_offsets``, ``CpuGroupedLinear`` over one in the
grouped layout (``cpu.grouped_layout``). The vLLM plugin holds one per compressed layer
(``vllm_adapter.layers``): ``cpu_serving_kernel`` says whether a layer gets one here, and
which (an unstructured bfloat16 layer is grouped on ``avx512_bf16`` kernels, elsewhere its
rows are spread: ``cpu.row_spread``). transformers' loader puts a ``CpuSparse24Linear`` or
``CpuBitmaskLinear`` in place of each compressed ``nn.Linear``
(``transformers_adapter.quantizer``), holding the checkpoint's tensors as stored.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import torch

from whisper_modifiers.sparse_serving.cpu.grouped_layout import group_for_op
from whisper_modifiers.sparse_serving.cpu.op import (
    CPU_KERNEL_DTYPES,
    bitmask_cpu_linear,
    cpu_kernels_unavailable,
    grouped_cpu_linear,
    grouped_layout_runs,
    sparse24_cpu_linear,
)
from whisper_modifiers.sparse_serving.cpu.plans import CpuPlan, cpu_plan
from whisper_modifiers.sparse_serving.cpu.row_spread import spread_for_op
from whisper_modifiers.sparse_serving.format.bitmask import check_bitmask
from whisper_modifiers.sparse_serving.format.two_four import check_compressed
from whisper_modifiers.sparse_serving.mode import KERNEL_MODE_VARIABLE, kernel_mode

__all__ = [
    "CpuBitmaskLinear",
    "CpuGroupedLinear",
    "CpuSparse24Linear",
    "cpu_serving_kernel",
    "cpu_serving_refusal",
]


def _density(values: int, rows: int, columns: int) -> float:
    """The share of a ``[rows, columns]`` weight that ``values`` kept values fill."""
    return values / max(1, rows * columns)


def _frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)


class _CpuCompressedLinear(torch.nn.Module):
    """What both layouts' modules share: the checkpoint's ``shape`` (``[[out], [in]]``, kept
    so that the module loads and saves as the checkpoint stores the layer), a bias, the
    plan, and ``forward``."""

    layout = ""
    kept_values: int | None = None  # an unstructured layer's, for its density

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype, device,
                 plan: CpuPlan | None):  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.shape = _frozen(torch.tensor([[out_features], [in_features]], device=device))
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
        self.plan = plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)

    def plan_paths(self) -> CpuPlan:
        """The measured plan of this shape, dtype and layout (``cpu.plans``), kept."""
        self.plan = cpu_plan(self.out_features, self.in_features, self.compressed.dtype,
                             self.density())  # fmt: skip
        return self.plan

    def density(self) -> float | None:
        """The share of the weight kept (None: a 2:4 layer)."""
        if self.kept_values is None:
            return None
        return _density(self.kept_values, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        paths = "paths not measured yet" if self.plan is None else self.plan.describe()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"compressed {self.layout}, {paths}")  # fmt: skip


class CpuSparse24Linear(_CpuCompressedLinear):
    """A 2:4 Linear whose weight is its ``compressed`` values and ``bitmask``
    (``format.two_four``'s layout, also the checkpoint's parameter names)."""

    layout = "2:4"

    def __init__(self, out_features: int, in_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None,
                 plan: CpuPlan | None = None):  # fmt: skip
        super().__init__(out_features, in_features, bias, dtype, device, plan)
        self.compressed = _frozen(torch.empty(out_features, in_features // 2, dtype=dtype,
                                              device=device))  # fmt: skip
        self.bitmask = _frozen(torch.empty(out_features, -(-in_features // 8), dtype=torch.uint8,
                                           device=device))  # fmt: skip

    @classmethod
    def from_compressed(cls, compressed: torch.Tensor, bitmask: torch.Tensor, in_features: int,
                        name: str = "weight", plan: CpuPlan | None = None):  # fmt: skip
        """A module over loaded tensors, after ``check_compressed`` (the op reads the kept
        values of 32 inputs at ``k / 2``: every group must mark exactly two)."""
        check_compressed(compressed, bitmask, (compressed.shape[0], in_features), name)
        module = cls(compressed.shape[0], in_features, dtype=compressed.dtype, device="meta",
                     plan=plan)  # fmt: skip
        module.compressed, module.bitmask = _frozen(compressed), _frozen(bitmask)
        module.shape = _frozen(torch.tensor([[compressed.shape[0]], [in_features]]))
        return module

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + bias`` (vLLM passes the bias itself)."""
        plan = self.plan or self.plan_paths()
        return sparse24_cpu_linear(x, self.compressed, self.bitmask, bias, self.in_features,
                                   plan.tiled_from, plan.gemm_from, plan.lanes_until,
                                   plan.brgemm_until)  # fmt: skip


class CpuBitmaskLinear(_CpuCompressedLinear):
    """An unstructured sparse Linear whose weight is its ``compressed`` values (1-D, each
    row's from its ``row_offsets`` entry on), ``bitmask`` and ``row_offsets``
    (``format.bitmask``'s layout, also the checkpoint's parameter names; ``from_compressed``
    may leave unused values between rows); ``values`` is how many values it keeps."""

    layout = "unstructured"

    def __init__(self, out_features: int, in_features: int, values: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None,
                 plan: CpuPlan | None = None):  # fmt: skip
        super().__init__(out_features, in_features, bias, dtype, device, plan)
        self.kept_values = values
        self.compressed = _frozen(torch.empty(values, dtype=dtype, device=device))
        self.bitmask = _frozen(torch.empty(out_features, -(-in_features // 8), dtype=torch.uint8,
                                           device=device))  # fmt: skip
        self.row_offsets = _frozen(torch.empty(out_features, dtype=torch.int64, device=device))

    @classmethod
    def from_compressed(cls, values: torch.Tensor, bitmask: torch.Tensor,
                        row_offsets: torch.Tensor, in_features: int, name: str = "weight",
                        plan: CpuPlan | None = None):  # fmt: skip
        """A module over loaded tensors, after ``check_bitmask`` (the op reads each row's
        values from its offset, by the bitmask's popcounts), its rows spread in memory where
        they are near a multiple of 4 KiB (``cpu.row_spread``; the module then holds the
        spread copy, not the checkpoint's layout)."""
        rows = bitmask.shape[0]
        check_bitmask(values, bitmask, row_offsets, (rows, in_features), name)
        module = cls(rows, in_features, values.numel(), dtype=values.dtype, device="meta",
                     plan=plan)  # fmt: skip
        values, row_offsets = spread_for_op(values, row_offsets.to(torch.int64))
        module.compressed, module.bitmask = _frozen(values), _frozen(bitmask)
        module.row_offsets = _frozen(row_offsets)
        module.shape = _frozen(torch.tensor([[rows], [in_features]]))
        return module

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + bias`` (vLLM passes the bias itself)."""
        plan = self.plan or self.plan_paths()
        return bitmask_cpu_linear(x, self.compressed, self.bitmask, self.row_offsets, bias,
                                  self.in_features, plan.tiled_from, plan.gemm_from,
                                  plan.brgemm_until)  # fmt: skip


class CpuGroupedLinear(_CpuCompressedLinear):
    """An unstructured sparse bfloat16 Linear in the grouped layout (``cpu.grouped_layout``):
    ``compressed`` (the groups' streams of kept values), ``group_masks`` and
    ``group_offsets``; ``kept_values`` is how many values it keeps. Built only from a
    checked layer (``from_compressed``), by the vLLM plugin; it holds no copy of the
    checkpoint's layout."""

    layout = "unstructured, grouped"

    @classmethod
    def from_compressed(cls, values: torch.Tensor, bitmask: torch.Tensor,
                        row_offsets: torch.Tensor, in_features: int, name: str = "weight",
                        plan: CpuPlan | None = None):  # fmt: skip
        """A module over loaded tensors (``format.bitmask``'s layout), after
        ``check_bitmask``, regrouped (``group_for_op``: in huge pages where offered)."""
        rows = bitmask.shape[0]
        check_bitmask(values, bitmask, row_offsets, (rows, in_features), name)
        module = cls(rows, in_features, False, values.dtype, "meta", plan)
        grouped, group_masks, group_offsets = group_for_op(values, bitmask, row_offsets,
                                                           in_features)  # fmt: skip
        module.kept_values = values.numel()
        module.compressed, module.group_masks = _frozen(grouped), _frozen(group_masks)
        module.group_offsets = _frozen(group_offsets)
        module.shape = _frozen(torch.tensor([[rows], [in_features]]))
        return module

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + bias`` (vLLM passes the bias itself)."""
        plan = self.plan or self.plan_paths()
        return grouped_cpu_linear(x, self.compressed, self.group_masks, self.group_offsets, bias,
                                  self.in_features, self.out_features, plan.tiled_from,
                                  plan.gemm_from, plan.brgemm_until)  # fmt: skip


def cpu_serving_refusal(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why compressed layers of ``dtype`` on ``device`` are not run by the CPU op here (None
    where they are, unless the plan says dense is faster; ``cpu_serving_kernel``)."""
    if kernel_mode() == "dense":
        return f"the kernel mode is dense (${KERNEL_MODE_VARIABLE})"
    if torch.device(device).type != "cpu":
        return f"the weights are on {torch.device(device).type}, not the CPU"
    if dtype not in CPU_KERNEL_DTYPES:
        return f"the CPU op takes float32 and bfloat16, not {str(dtype).split('.')[-1]}"
    return cpu_kernels_unavailable()


def cpu_serving_kernel(compressed: torch.Tensor, bitmask: torch.Tensor, in_features: int,
                       name: str = "weight", row_offsets: torch.Tensor | None = None,
                       ) -> _CpuCompressedLinear | None:  # fmt: skip
    """The op's module for a loaded layer (2:4, or unstructured where ``row_offsets`` are
    given: grouped where ``grouped_layout_runs``, else its rows spread), or None where the
    layer runs dense: the kernel mode is ``dense``, the op cannot run here
    (``cpu_serving_refusal``), or, in the ``auto`` mode, the measured plan of its shape and
    layout has the op slower than dense at one token. ``sparse`` runs the op wherever it
    can."""
    if cpu_serving_refusal(compressed.device, compressed.dtype) is not None:
        return None
    rows = bitmask.shape[0]
    density = None if row_offsets is None else _density(compressed.numel(), rows, in_features)
    plan = cpu_plan(rows, in_features, compressed.dtype, density)
    if kernel_mode() == "auto" and not plan.faster_at_decode:
        return None
    if row_offsets is None:
        return CpuSparse24Linear.from_compressed(compressed, bitmask, in_features, name, plan)
    kind = CpuGroupedLinear if grouped_layout_runs(compressed.dtype) else CpuBitmaskLinear
    return kind.from_compressed(compressed, bitmask, row_offsets, in_features, name, plan)
