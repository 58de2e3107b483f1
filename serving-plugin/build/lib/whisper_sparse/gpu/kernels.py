"""2:4 layers that run cuSPARSELt's GEMM where their ``DispatchPlan`` says it is faster:
``Sparse24Linear`` (a drop-in ``nn.Linear``), fused q/k/v and gate/up groups, and
``accelerate(model)`` which swaps them into a transformers model in place; and the GPU
kernel the vLLM plugin uses, by the serving kernel mode (``serving_kernel``, ``mode``; the
CPU's is ``cpu.linear``'s). The op is ``gpu.sparse_op``'s, the plans ``gpu.dispatch_plans``'.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import torch

from whisper_sparse.format.two_four import NotTwoFourError, check_two_four
from whisper_sparse.gpu.dispatch_plans import DENSE_ONLY, DispatchPlan, plan_for
from whisper_sparse.gpu.sparse_op import (
    kernel_shape_ok,
    sparse24_linear,
    sparse_kernel_available,
)
from whisper_sparse.mode import kernel_mode

__all__ = [
    "FusedPart",
    "FusedSparse24Linear",
    "Sparse24Linear",
    "accelerate",
    "serving_kernel",
]


class Sparse24Linear(torch.nn.Module):
    """A drop-in ``nn.Linear`` for a 2:4 weight: cuSPARSELt's GEMM where its plan says it
    is faster, dense elsewhere; exactly ``F.linear`` where the kernel cannot run.

    ``keep_dense=False`` drops the dense weight where the kernel runs (about 56 % of the
    weight's memory instead of 156 %) and then always runs sparse, also where it is slower
    (decode).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        keep_dense: bool = True,
        plan: DispatchPlan | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.compressed = None
        self.plan = DENSE_ONLY
        if sparse_kernel_available(weight.device, weight.dtype) and kernel_shape_ok(weight):
            check_two_four(weight.detach(), "weight")
            self.compressed = torch._cslt_compress(weight.detach())
            if keep_dense:
                self.plan = plan or plan_for(self.compressed, weight.detach())
            else:
                self.plan = DispatchPlan.always_sparse(plan)
        self.dense = weight.detach() if self.plan.uses_dense() else None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, keep_dense: bool = True) -> Sparse24Linear:
        return cls(linear.weight, linear.bias, keep_dense=keep_dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + bias`` (vLLM passes the bias itself)."""
        plan = self.plan
        return sparse24_linear(
            x,
            self.compressed,
            self.dense,
            bias,
            self.out_features,
            plan.sparse_from,
            list(plan.ladder),
            list(plan.algorithms),
        )

    def extra_repr(self) -> str:
        where = (
            "dense" if self.compressed is None else f"sparse from {self.plan.sparse_from} tokens"
        )
        return f"in_features={self.in_features}, out_features={self.out_features}, {where}"


def serving_kernel(weight: torch.Tensor) -> Sparse24Linear | None:
    """The kernel a server uses for a loaded 2:4 ``weight``, by ``kernel_mode()``; None
    where it would only run dense (CPU, float32, ``dense``)."""
    mode = kernel_mode()
    if mode == "dense" or not (
        sparse_kernel_available(weight.device, weight.dtype) and kernel_shape_ok(weight)
    ):
        return None
    return Sparse24Linear(weight, keep_dense=mode == "auto")


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections that read the same input in transformers' decoders; ``accelerate``
runs each group as one GEMM, as vLLM does (``qkv_proj``, ``gate_up_proj``)."""


class FusedSparse24Linear(torch.nn.Module):
    """Sibling Linear layers that read the same input, as one ``Sparse24Linear`` on their
    stacked weights; ``FusedPart`` modules stand in for the layers. The first part called
    with an input runs the GEMM for all; the others called with that same tensor take
    their slice of it. A part called with another input (or twice) runs the GEMM again, so
    the result never depends on the call pattern, only its speed does."""

    def __init__(self, linears: list[torch.nn.Linear], *, keep_dense: bool = True):
        super().__init__()
        biases = [linear.bias for linear in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.kernel = Sparse24Linear(weight, bias, keep_dense=keep_dense)
        self.sizes = [linear.out_features for linear in linears]
        self._input = None
        self._parts: list[torch.Tensor | None] = []

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x or self._parts[index] is None:
            self._parts = list(self.kernel(x).split(self.sizes, dim=-1))
            self._input = x
        result, self._parts[index] = self._parts[index], None
        if all(p is None for p in self._parts):
            self._input = None  # every part taken: hold no activations between calls
        return result


class FusedPart(torch.nn.Module):
    """One layer of a ``FusedSparse24Linear`` group, in that layer's place."""

    def __init__(self, fused: FusedSparse24Linear, index: int):
        super().__init__()
        self.fused = fused
        self.index = index
        self.out_features = fused.sizes[index]
        self.in_features = fused.kernel.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)


def _fusable(linears: list) -> bool:
    if any(type(linear) is not torch.nn.Linear for linear in linears):
        return False
    first = linears[0].weight
    return (
        len({linear.in_features for linear in linears}) == 1
        and len({linear.bias is None for linear in linears}) == 1
        and all(linear.weight.dtype == first.dtype for linear in linears)
        and all(linear.weight.device == first.device for linear in linears)
        and sparse_kernel_available(first.device, first.dtype)
        and all(_is_two_four(linear.weight) for linear in linears)
    )


def accelerate(
    model: torch.nn.Module, *, keep_dense: bool = True, fuse: bool = True, include=None
) -> list[str]:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose weight is exactly 2:4
    (and whose name ``include`` accepts, when given) by a ``Sparse24Linear``; with
    ``fuse``, where the sparse kernel runs, the groups of ``FUSED_GROUPS`` become one
    ``FusedSparse24Linear`` each. Returns the replaced names. Layers whose weights are
    not 2:4 (an LM head) stay as they are."""
    replaced = []
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        accepted = {
            child_name: child
            for child_name, child in module.named_children()
            if type(child) is torch.nn.Linear and (not include or include(prefix + child_name))
        }
        for group in FUSED_GROUPS if fuse else ():
            linears = [accepted.get(child_name) for child_name in group]
            if None in linears or not _fusable(linears):
                continue
            fused = FusedSparse24Linear(linears, keep_dense=keep_dense)
            for index, child_name in enumerate(group):
                setattr(module, child_name, FusedPart(fused, index))
                del accepted[child_name]
                replaced.append(prefix + child_name)
        for child_name, child in accepted.items():
            if _is_two_four(child.weight):
                setattr(
                    module, child_name, Sparse24Linear.from_linear(child, keep_dense=keep_dense)
                )
                replaced.append(prefix + child_name)
    return replaced


def _is_two_four(weight: torch.Tensor) -> bool:
    try:
        check_two_four(weight.detach(), "weight")
    except NotTwoFourError:
        return False
    return True
