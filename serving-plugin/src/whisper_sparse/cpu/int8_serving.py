"""W8A8 layers served from their stored int8 values by the W8A8 op (``cpu.int8_op``), on the
path of a plan measured per shape against the dense W8A8 layer the caller names
(``dense_for``: the vLLM plugin passes vLLM's own), and cached with the bfloat16 plans
(``cpu.plans``, under the int8 dtype).

At each ``INT8_LADDER`` count, on a random int8 weight of the shape and layout, the op's row
kernels, its tiles (``int8_op.int8_paths``, where they run) and the dense layer are timed in
turn, round after round (``plan_timing.timed_point``). The tiles take every count from the lowest at
and above which they never lost to the rows; ``faster_at_decode`` says whether the op beat
the dense layer at one token (where it lost, the ``auto`` kernel mode serves the layer dense).

Imports only torch (and this subpackage).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from whisper_sparse.cpu.int8_op import int8_cpu_linear, int8_kernels, int8_paths, int8_quantize
from whisper_sparse.cpu.op import PathThresholds
from whisper_sparse.cpu.plan_timing import timed_point
from whisper_sparse.cpu.plans import CpuPlan, cpu_plan, first_of_winning_run, time_ratio
from whisper_sparse.cpu.served_layer import random_two_four, random_unstructured, share_kept
from whisper_sparse.format.bitmask import compress_bitmask
from whisper_sparse.format.two_four import compress_24
from whisper_sparse.mode import kernel_mode

__all__ = ["INT8_LADDER", "Int8ServedLayer", "int8_plan", "int8_serving_kernel", "row_scales"]

INT8_LADDER = (1, 4, 16, 64, 256, 512)


def row_scales(weight_scale: torch.Tensor, widths: list[int], rows: int) -> torch.Tensor:
    """A W8A8 layer's ``weight_scale`` (per output row, per fused part or per tensor) as one
    float32 scale per output row."""
    scale = weight_scale.reshape(-1).to(torch.float32)
    if scale.numel() == len(widths) and scale.numel() != rows:  # per fused part
        scale = scale.repeat_interleave(torch.tensor(widths))
    return scale.expand(rows).contiguous()


def stored_int8(weight: torch.Tensor, density: float | None):
    """``(values, bitmask, row_offsets)`` of an int8 weight in the layout (None: 2:4)."""
    if density is None:
        return (*compress_24(weight), None)
    return compress_bitmask(weight)


def random_int8(rows: int, columns: int, density: float | None) -> torch.Tensor:
    """A random int8 weight, pruned 2:4 (``density`` None) or keeping ``density`` of it."""
    if density is None:
        weight = random_two_four(rows, columns, torch.float32)
    else:
        weight = random_unstructured(rows, columns, torch.float32, density)
    return (weight * 40).round().clamp(-127, 127).to(torch.int8)


def int8_timings(rows: int, columns: int, density: float | None, dense_for) -> list[dict]:
    """Per ``INT8_LADDER`` count, the wall times of the op's paths and of
    ``dense_for(weight, scales)`` on a random weight of the layout (``{name}_rounds``, each
    round's; ``{name}_s``, their median)."""
    weight = random_int8(rows, columns, density)
    scales = torch.rand(rows, 1, dtype=torch.float32) * 1e-3 + 1e-4
    dense = dense_for(weight, scales)
    layer = Int8ServedLayer(*stored_int8(weight, density), scales.reshape(-1), columns)
    paths = int8_paths()
    timings = []
    with torch.no_grad():
        for tokens in INT8_LADDER:
            x = torch.randn(tokens, columns, dtype=torch.float32).to(torch.bfloat16)
            fns = {"dense": lambda x=x: dense(x)}
            fns |= {p: lambda x=x, t=t: layer.run(x, None, t) for p, t in paths.items()}
            timings.append(timed_point(tokens, fns))
    return timings


def int8_plan_from_timings(timings: list[dict]) -> CpuPlan:
    """The tiles from the lowest count at and above which they never lost to the rows; the
    op on its chosen path against the dense layer at each count."""
    tiled_from = first_of_winning_run(timings, "tiles", ["rows"])
    paths = PathThresholds(tiled_from=tiled_from)
    speedups = tuple(
        (t["tokens"], time_ratio(t, "dense", "tiles" if t["tokens"] >= tiled_from else "rows"))
        for t in timings
    )
    return CpuPlan(**asdict(paths), faster_at_decode=speedups[0][1] >= 1.0, speedups=speedups)


def int8_plan(rows: int, columns: int, density: float | None, dense_for) -> CpuPlan:
    """The W8A8 plan of a shape and layout here (``cpu.plans.cpu_plan``'s cache)."""

    def measure(rounded: float | None):
        timings = int8_timings(rows, columns, rounded, dense_for)
        return int8_plan_from_timings(timings), timings

    return cpu_plan(rows, columns, torch.int8, density, measure=measure)


class Int8ServedLayer:
    """A W8A8 layer as stored (2:4: ``values`` ``[out, in / 2]``; unstructured: 1-D with
    ``row_offsets``), its float32 scale per output row, the plan it runs on, and the rounding
    of the vLLM dense W8A8 kernel it equals (``int8_op.ROUNDINGS``): the activations are
    quantized and the sums scaled as that kernel does."""

    def __init__(
        self, values, bitmask, row_offsets, scale, in_features, plan=None, rounding="onednn"
    ):
        self.values, self.bitmask, self.row_offsets = values, bitmask, row_offsets
        self.scale = scale.to(torch.float32).contiguous()
        self.in_features, self.out_features = in_features, bitmask.shape[0]
        self.plan = plan
        self.rounding = rounding

    def density(self) -> float | None:
        """The share of the weight kept (None: a 2:4 layer)."""
        if self.row_offsets is None:
            return None
        return share_kept(self.values.numel(), self.out_features, self.in_features)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None, tiles_from: int) -> torch.Tensor:
        x_q, x_scale = int8_quantize(x.reshape(-1, self.in_features), self.rounding)
        y = int8_cpu_linear(
            x_q,
            x_scale,
            self.values,
            self.bitmask,
            self.scale,
            self.in_features,
            self.row_offsets,
            bias,
            x.dtype,
            tiles_from,
            self.rounding,
        )
        return y.reshape(*x.shape[:-1], self.out_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``y`` on the plan's path for x's number of tokens."""
        return self.run(x, bias, self.plan.tiled_from)


def int8_serving_kernel(
    stored, weight_scale, widths, in_features, dense_for, rounding="onednn"
) -> Int8ServedLayer | None:
    """The W8A8 op's layer for a loaded layer's ``(values, bitmask, row_offsets)``, rounding as
    the dense kernel ``dense_for`` stands for does (``rounding``), or None where it runs dense:
    no W8A8 kernel runs here, the kernel mode is ``dense``, or in ``auto`` its plan lost to
    ``dense_for``'s layer at one token."""
    values, bitmask, row_offsets = stored
    if values.dtype != torch.int8 or values.device.type != "cpu":
        return None
    if int8_kernels() == "none" or kernel_mode() == "dense":
        return None
    rows = bitmask.shape[0]
    density = None if row_offsets is None else share_kept(values.numel(), rows, in_features)
    plan = int8_plan(rows, in_features, density, dense_for)
    if kernel_mode() == "auto" and not plan.faster_at_decode:
        return None
    scale = row_scales(weight_scale, widths, rows)
    return Int8ServedLayer(values, bitmask, row_offsets, scale, in_features, plan, rounding)
