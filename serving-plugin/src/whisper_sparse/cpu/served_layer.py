"""A compressed layer's served form on this CPU: the tensors the sparse CPU op reads.

``served_layer`` is the one place that builds it, from a layer's stored tensors (checked
first) and what this CPU's kernels read best:

* a 2:4 layer: its ``compressed`` and ``bitmask`` as stored (``TwoFourLayer``);
* an unstructured layer, bfloat16 on ``avx512_bf16`` kernels: the grouped layout
  (``GroupedLayer``, ``cpu.grouped_layout``, in huge pages where offered);
* any other unstructured layer: its rows, spread where they lie near a multiple of 4 KiB
  (``RowsLayer``, ``cpu.row_spread``), or as stored where the caller saves them back
  (``as_stored``: transformers' modules).

The factory does not consult a plan: a plan (``cpu.plans``) says which path each token
count takes, and whether the ``auto`` mode serves the layer dense. The plan timer asks
``random_served_layer`` for the random layers it times, so that it times the form served.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from whisper_sparse.cpu.grouped_layout import group_for_op
from whisper_sparse.cpu.op import (
    ROWS_ONLY,
    PathThresholds,
    bitmask_cpu_linear,
    grouped_cpu_linear,
    grouped_layout_runs,
    two_four_cpu_linear,
)
from whisper_sparse.cpu.row_spread import spread_for_op
from whisper_sparse.format.bitmask import compress_bitmask
from whisper_sparse.format.layout import check_stored
from whisper_sparse.format.two_four import compress_24

__all__ = [
    "GroupedLayer",
    "RowsLayer",
    "ServedLayer",
    "TwoFourLayer",
    "random_served_layer",
    "random_two_four",
    "random_unstructured",
    "served_layer",
    "share_kept",
]


def share_kept(kept_values: int, out_features: int, in_features: int) -> float:
    """The share of a ``[out_features, in_features]`` weight that ``kept_values`` fill."""
    return kept_values / max(1, out_features * in_features)


class ServedLayer:
    """What every served form gives: its sizes, how many values it keeps (None: 2:4), its
    tensors by the names the modules hold them under, and ``linear``."""

    layout = ""
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.compressed.dtype

    @property
    def kept_values(self) -> int | None:
        return None

    def density(self) -> float | None:
        """The share of the weight kept (None: a 2:4 layer)."""
        if self.kept_values is None:
            return None
        return share_kept(self.kept_values, self.out_features, self.in_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def linear(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        thresholds: PathThresholds = ROWS_ONLY,
    ) -> torch.Tensor:
        """``x Wᵀ + bias`` by the op, on the path ``thresholds`` gives each token count."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class TwoFourLayer(ServedLayer):
    """A 2:4 layer: ``compressed`` ``[out, in / 2]`` and ``bitmask`` (``format.two_four``)."""

    compressed: torch.Tensor
    bitmask: torch.Tensor
    in_features: int
    layout = "2:4"

    @property
    def out_features(self) -> int:
        return self.compressed.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"compressed": self.compressed, "bitmask": self.bitmask}

    def linear(self, x, bias=None, thresholds=ROWS_ONLY):
        return two_four_cpu_linear(
            x, self.compressed, self.bitmask, bias, self.in_features, thresholds
        )


@dataclass(frozen=True, eq=False)
class RowsLayer(ServedLayer):
    """An unstructured layer's rows: ``compressed`` (1-D, each row's kept values from its
    ``row_offsets`` entry on) and ``bitmask`` (``format.bitmask``); ``kept``: how many
    values it keeps (a spread copy leaves unused values between rows)."""

    compressed: torch.Tensor
    bitmask: torch.Tensor
    row_offsets: torch.Tensor
    in_features: int
    kept: int
    layout = "unstructured"

    @property
    def out_features(self) -> int:
        return self.bitmask.shape[0]

    @property
    def kept_values(self) -> int:
        return self.kept

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "compressed": self.compressed,
            "bitmask": self.bitmask,
            "row_offsets": self.row_offsets,
        }

    def linear(self, x, bias=None, thresholds=ROWS_ONLY):
        return bitmask_cpu_linear(
            x,
            self.compressed,
            self.bitmask,
            self.row_offsets,
            bias,
            self.in_features,
            thresholds,
        )


@dataclass(frozen=True, eq=False)
class GroupedLayer(ServedLayer):
    """An unstructured bfloat16 layer in the grouped layout (``cpu.grouped_layout``):
    ``compressed`` (the groups' streams of kept values), ``group_masks`` and
    ``group_offsets``; ``kept``: how many values it keeps."""

    compressed: torch.Tensor
    group_masks: torch.Tensor
    group_offsets: torch.Tensor
    in_features: int
    out_features: int
    kept: int
    layout = "unstructured, grouped"

    @property
    def kept_values(self) -> int:
        return self.kept

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "compressed": self.compressed,
            "group_masks": self.group_masks,
            "group_offsets": self.group_offsets,
        }

    def linear(self, x, bias=None, thresholds=ROWS_ONLY):
        return grouped_cpu_linear(
            x,
            self.compressed,
            self.group_masks,
            self.group_offsets,
            bias,
            self.in_features,
            self.out_features,
            thresholds,
        )


def served_layer(
    compressed: torch.Tensor,
    bitmask: torch.Tensor,
    in_features: int,
    row_offsets: torch.Tensor | None = None,
    name: str = "weight",
    as_stored: bool = False,
    grouped: bool | None = None,
) -> ServedLayer:
    """The served form of a layer's stored tensors (2:4, or unstructured where
    ``row_offsets`` are given), after their check (``format.layout.check_stored``:
    the op reads the kept values by position). ``as_stored``: an unstructured layer's rows
    as stored, for a caller that saves them back; ``grouped``: whether an unstructured
    layer is grouped (None: where ``grouped_layout_runs``; benchmarks compare both)."""
    rows = bitmask.shape[0]
    check_stored(compressed, bitmask, row_offsets, (rows, in_features), name)
    if row_offsets is None:
        return TwoFourLayer(compressed, bitmask, in_features)
    kept = compressed.numel()
    row_offsets = row_offsets.to(torch.int64)  # legacy checkpoints store int32
    if as_stored:
        return RowsLayer(compressed, bitmask, row_offsets, in_features, kept)
    if grouped_layout_runs(compressed.dtype) if grouped is None else grouped:
        grouped = group_for_op(compressed, bitmask, row_offsets, in_features)
        return GroupedLayer(*grouped, in_features, rows, kept)
    values, row_offsets = spread_for_op(compressed, row_offsets)
    return RowsLayer(values, bitmask, row_offsets, in_features, kept)


def random_two_four(rows: int, columns: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random exactly 2:4 weight (the two largest of every four kept)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator).to(dtype)
    groups = weight.reshape(rows, -1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.abs().topk(2, dim=-1).indices, True)
    return (groups * keep).reshape(rows, columns)


def random_unstructured(
    rows: int, columns: int, dtype: torch.dtype, density: float, seed: int = 0
) -> torch.Tensor:
    """A random weight keeping ``density`` of its values, anywhere (by a random score)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator).to(dtype)
    return weight * (torch.rand(rows, columns, generator=generator) < density)


def random_served_layer(
    out_features: int, in_features: int, dtype: torch.dtype, density: float | None = None
) -> tuple[torch.Tensor, ServedLayer]:
    """A random weight of the layout (2:4 where ``density`` is None, else unstructured at
    ``density``) and its served form here."""
    if density is None:
        dense = random_two_four(out_features, in_features, dtype)
        return dense, served_layer(*compress_24(dense), in_features)
    dense = random_unstructured(out_features, in_features, dtype, density)
    values, bitmask, row_offsets = compress_bitmask(dense)
    return dense, served_layer(values, bitmask, in_features, row_offsets)
