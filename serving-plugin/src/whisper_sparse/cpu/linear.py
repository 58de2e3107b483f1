"""Linear modules that stay compressed on the CPU and run the sparse CPU op over their
served layer (``cpu.served_layer``) on the paths of their measured plan (``cpu.plans``).

* ``CpuSparseLinear``: the vLLM plugin's (``vllm_adapter.layers``), one per compressed
  layer, over the served form ``served_layer`` built; ``cpu_serving_kernel`` says whether a
  layer gets one here.
* ``CpuSparse24Linear`` and ``CpuBitmaskLinear``: transformers' loader puts one in place of
  each compressed ``nn.Linear`` (``transformers_adapter.quantizer``), with the checkpoint's
  parameter names, so that it loads and saves the tensors as stored; its served layer is
  built from them (``serve``) after loading.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import torch

from whisper_sparse.cpu.op import CPU_KERNEL_DTYPES, cpu_kernels_unavailable
from whisper_sparse.cpu.plans import CpuPlan, cpu_plan
from whisper_sparse.cpu.served_layer import ServedLayer, served_layer, share_kept
from whisper_sparse.mode import KERNEL_MODE_VARIABLE, kernel_mode

__all__ = [
    "CpuBitmaskLinear",
    "CpuSparse24Linear",
    "CpuSparseLinear",
    "cpu_serving_kernel",
    "cpu_serving_refusal",
]


def _frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)


class CpuSparseLinear(torch.nn.Module):
    """A compressed Linear run by the sparse CPU op: its served layer's tensors (under their
    names: ``compressed``, ``bitmask``, and ``row_offsets`` or the grouped layout's), the
    checkpoint's ``shape`` (``[[out], [in]]``), a bias, and the plan."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
        plan: CpuPlan | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.shape = _frozen(torch.tensor([[out_features], [in_features]], device=device))
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
        self.plan = plan
        self.served: ServedLayer | None = None

    @classmethod
    def serving(cls, served: ServedLayer, plan: CpuPlan | None = None) -> CpuSparseLinear:
        """A module over a served layer (``served_layer``), holding its tensors."""
        module = cls(served.out_features, served.in_features, plan=plan)
        for name, tensor in served.tensors().items():
            setattr(module, name, _frozen(tensor))
        module.served = served
        return module

    def serve(self) -> ServedLayer:
        """The served layer the op reads."""
        return self.served

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + bias`` (vLLM passes the bias itself)."""
        served = self.serve()
        return served.linear(x, bias, self.plan or self.plan_paths())

    def plan_paths(self) -> CpuPlan:
        """The measured plan of this shape, dtype and layout (``cpu.plans``), kept."""
        served = self.serve()
        self.plan = cpu_plan(self.out_features, self.in_features, served.dtype, self.density())
        return self.plan

    def density(self) -> float | None:
        """The share of the weight kept (None: a 2:4 layer)."""
        return self.serve().density()

    def extra_repr(self) -> str:
        paths = "paths not measured yet" if self.plan is None else self.plan.describe()
        layout = "not loaded yet" if self.served is None else self.served.layout
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"compressed {layout}, {paths}"
        )


class _StoredCpuLinear(CpuSparseLinear):
    """transformers' module: the checkpoint's tensors as parameters, and the served layer
    built from them on first use (again where they were replaced, by ``to()`` say)."""

    _served_from: tuple = ()

    def _stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def serve(self, name: str = "weight") -> ServedLayer:
        """The served layer of the loaded tensors, after their check (``served_layer``)."""
        stored = self._stored()
        source = tuple(None if t is None else t.data_ptr() for t in stored)
        if self.served is None or source != self._served_from:
            compressed, bitmask, row_offsets = stored
            self.served = served_layer(
                compressed, bitmask, self.in_features, row_offsets, name, as_stored=True
            )
            self._served_from = source
        return self.served


class CpuSparse24Linear(_StoredCpuLinear):
    """A 2:4 Linear whose weight is its ``compressed`` values and ``bitmask``
    (``format.two_four``'s layout, also the checkpoint's parameter names)."""

    def __init__(self, out_features, in_features, bias=False, dtype=torch.float32, device=None):
        super().__init__(out_features, in_features, bias, dtype, device)
        half, bytes_ = in_features // 2, -(-in_features // 8)
        self.compressed = _frozen(torch.empty(out_features, half, dtype=dtype, device=device))
        self.bitmask = _frozen(torch.empty(out_features, bytes_, dtype=torch.uint8, device=device))

    def _stored(self):
        return self.compressed, self.bitmask, None


class CpuBitmaskLinear(_StoredCpuLinear):
    """An unstructured sparse Linear whose weight is its ``compressed`` values (1-D, each
    row's from its ``row_offsets`` entry on), ``bitmask`` and ``row_offsets``
    (``format.bitmask``'s layout, also the checkpoint's parameter names); ``values`` is how
    many values it keeps."""

    def __init__(
        self,
        out_features,
        in_features,
        values: int,
        bias=False,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__(out_features, in_features, bias, dtype, device)
        bytes_ = -(-in_features // 8)
        self.compressed = _frozen(torch.empty(values, dtype=dtype, device=device))
        self.bitmask = _frozen(torch.empty(out_features, bytes_, dtype=torch.uint8, device=device))
        self.row_offsets = _frozen(torch.empty(out_features, dtype=torch.int64, device=device))

    def _stored(self):
        return self.compressed, self.bitmask, self.row_offsets


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


def cpu_serving_kernel(
    compressed: torch.Tensor,
    bitmask: torch.Tensor,
    in_features: int,
    name: str = "weight",
    row_offsets: torch.Tensor | None = None,
) -> CpuSparseLinear | None:
    """The op's module for a loaded layer (2:4, or unstructured where ``row_offsets`` are
    given; its served form from ``served_layer``), or None where the layer runs dense: the
    kernel mode is ``dense``, the op cannot run here (``cpu_serving_refusal``), or, in the
    ``auto`` mode, the measured plan of its shape and layout has the op slower than dense at
    one token. ``sparse`` runs the op wherever it can."""
    if cpu_serving_refusal(compressed.device, compressed.dtype) is not None:
        return None
    rows = bitmask.shape[0]
    # the plan first: where ``auto`` serves the layer dense, no served form is built
    density = None if row_offsets is None else share_kept(compressed.numel(), rows, in_features)
    plan = cpu_plan(rows, in_features, compressed.dtype, density)
    if kernel_mode() == "auto" and not plan.faster_at_decode:
        return None
    served = served_layer(compressed, bitmask, in_features, row_offsets, name)
    return CpuSparseLinear.serving(served, plan)
