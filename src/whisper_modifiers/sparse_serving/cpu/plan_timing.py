"""Timing the CPU op's paths for its plans (``plans``): a random weight of a layer's shape and
layout (2:4, or unstructured at a density), held as the served modules hold it, and each
path's and dense ``F.linear``'s wall time at each token count, round after round.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from whisper_modifiers.sparse_serving.cpu.grouped_layout import group_for_op
from whisper_modifiers.sparse_serving.cpu.op import (
    NO_TILES,
    bitmask_cpu_linear,
    brgemm_kernel,
    gemm_runs,
    grouped_cpu_linear,
    grouped_layout_runs,
    sparse24_cpu_linear,
)
from whisper_modifiers.sparse_serving.cpu.row_spread import spread_for_op
from whisper_modifiers.sparse_serving.format.bitmask import compress_bitmask
from whisper_modifiers.sparse_serving.format.two_four import compress_24

__all__ = [
    "PATHS",
    "PATH_THRESHOLDS",
    "bitmask_thresholds",
    "path_timings",
    "random_two_four",
    "random_unstructured",
]

TIME_BUDGET = 0.15  # seconds of runs per measured point and path (at least LEAST_ROUNDS)
LEAST_ROUNDS = 5  # rounds per measured point: a 512-token point of a 7B layer takes 0.1-0.6 s

PATHS = ("rows", "gemm", "lanes", "tiles", "brgemm")
# (tiled_from, gemm_from, lanes_until, brgemm_until) of the op that takes each path at every
# token count: sparse24_cpu_linear's order; bitmask_cpu_linear takes bitmask_thresholds'
PATH_THRESHOLDS = {"rows": (NO_TILES, NO_TILES, 0, 0), "gemm": (NO_TILES, 0, 0, 0),
                   "lanes": (NO_TILES, 0, NO_TILES, 0), "tiles": (0, NO_TILES, 0, 0),
                   "brgemm": (0, NO_TILES, 0, NO_TILES)}  # fmt: skip


def bitmask_thresholds(thresholds: tuple) -> tuple:
    """A ``PATH_THRESHOLDS`` entry in ``bitmask_cpu_linear``'s order (no lanes)."""
    tiled_from, gemm_from, _, brgemm_until = thresholds
    return tiled_from, gemm_from, brgemm_until


def random_two_four(rows: int, columns: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random exactly 2:4 weight (the two largest of every four kept)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator).to(dtype)
    groups = weight.reshape(rows, -1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.abs().topk(2, dim=-1).indices, True)
    return (groups * keep).reshape(rows, columns)


def random_unstructured(rows: int, columns: int, dtype: torch.dtype, density: float,
                        seed: int = 0) -> torch.Tensor:  # fmt: skip
    """A random weight keeping ``density`` of its values, anywhere (by a random score)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator).to(dtype)
    return weight * (torch.rand(rows, columns, generator=generator) < density)


def _measured_paths(dtype: torch.dtype, density: float | None) -> list[str]:
    """The paths worth timing here: the rows and the tiles; the GEMM where it runs (and for a
    2:4 layer the lanes); the micro-kernel's tiles where they run on AMX tiles (on the Zen 5
    EPYC's AVX512_BF16 micro-kernel they lost to the GEMM on every 7B shape timed, from 16
    to 512 tokens: docs/serving.md, "On an AMX Xeon")."""
    gemm = gemm_runs(dtype, dtype)
    extra = {"gemm": gemm, "lanes": gemm and density is None,
             "brgemm": gemm and brgemm_kernel() == "amx"}  # fmt: skip
    return [path for path in PATHS if path in ("rows", "tiles") or extra[path]]


def _op_paths(out_features: int, in_features: int, dtype: torch.dtype,
              density: float | None) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """A random weight of the layout (2:4 where ``density`` is None, else unstructured at
    ``density``, held as the served modules hold it: grouped where ``grouped_layout_runs``,
    else its rows spread, ``cpu.row_spread``) and, by
    path, ``run(x)`` of the op on it (the GEMMs where they run; "lanes", the unstructured
    GEMM over a 2:4 layer's rows, for 2:4 layers)."""
    paths = _measured_paths(dtype, density)
    if density is None:
        dense = random_two_four(out_features, in_features, dtype)
        compressed, bitmask = compress_24(dense)
        return dense, {path: lambda x, t=PATH_THRESHOLDS[path]: sparse24_cpu_linear(
            x, compressed, bitmask, None, in_features, *t) for path in paths}  # fmt: skip
    dense = random_unstructured(out_features, in_features, dtype, density)
    values, bitmask, row_offsets = compress_bitmask(dense)
    if grouped_layout_runs(dtype):  # in the layout the served modules hold here
        grouped = group_for_op(values, bitmask, row_offsets, in_features)
        return dense, {path: lambda x, t=PATH_THRESHOLDS[path]: grouped_cpu_linear(
            x, *grouped, None, in_features, out_features, *bitmask_thresholds(t))
            for path in paths}  # fmt: skip
    values, row_offsets = spread_for_op(values, row_offsets)  # as CpuBitmaskLinear holds them
    return dense, {path: lambda x, t=PATH_THRESHOLDS[path]: bitmask_cpu_linear(
        x, values, bitmask, row_offsets, None, in_features, *bitmask_thresholds(t))
        for path in paths}  # fmt: skip


def _rounds(fns: dict) -> dict:
    """Wall times of each of ``fns``, run in turn, round after round: at least
    ``LEAST_ROUNDS`` rounds, and until each has had ``TIME_BUDGET`` seconds (at most 50
    rounds)."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    while len(next(iter(times.values()))) < LEAST_ROUNDS or (
            min(map(sum, times.values())) < TIME_BUDGET and len(times["dense"]) < 50):  # fmt: skip
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def path_timings(out_features: int, in_features: int, dtype: torch.dtype, ladder,
                 density: float | None = None) -> list[dict]:  # fmt: skip
    """Per ``ladder`` token count, the wall times of the op's paths (``_op_paths``) and of
    dense ``F.linear`` on a random weight of the layout: ``{name}_rounds``, each round's
    time, and ``{name}_s``, their median (``tokens``: the count)."""
    dense, paths = _op_paths(out_features, in_features, dtype, density)
    timings = []
    with torch.no_grad():
        for tokens in ladder:
            x = torch.randn(tokens, in_features).to(dtype)
            fns = {"dense": lambda x=x: F.linear(x, dense)}
            fns |= {path: lambda x=x, run=run: run(x) for path, run in paths.items()}
            rounds = _rounds(fns)
            timings.append({"tokens": tokens}
                           | {f"{name}_s": statistics.median(r) for name, r in rounds.items()}
                           | {f"{name}_rounds": r for name, r in rounds.items()})  # fmt: skip
    return timings
