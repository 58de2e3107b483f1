"""Timing the CPU op's paths for its plans (``plans``): a random layer of a shape and
layout (2:4, or unstructured at a density) in its served form (``served_layer``), and each
path's and dense ``F.linear``'s wall time at each token count, round after round.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from whisper_sparse.cpu.op import PATHS, PathThresholds, brgemm_kernel, gemm_runs
from whisper_sparse.cpu.served_layer import random_served_layer

__all__ = ["path_timings", "rounds_in_turn", "timed_point"]

TIME_BUDGET = 0.15  # seconds of runs per measured point and path (at least LEAST_ROUNDS)
LEAST_ROUNDS = 5  # rounds per measured point: a slow spell then moves its median little


def _measured_paths(dtype: torch.dtype, density: float | None) -> list[str]:
    """The paths worth timing here: the rows and the tiles; the GEMM where it runs (and for a
    2:4 layer the lanes); the micro-kernel tiles where they run on AMX (oneDNN's
    AVX512_BF16 micro-kernel lost to the GEMM on every 7B shape: benchmarks/results/JOURNAL.md)."""
    gemm = gemm_runs(dtype, dtype)
    extra = {
        "gemm": gemm,
        "lanes": gemm and density is None,
        "brgemm": gemm and brgemm_kernel() == "amx",
    }
    return [path for path in PATHS if path in ("rows", "tiles") or extra[path]]


def rounds_in_turn(fns: dict) -> dict:
    """Wall times of each of ``fns``, run in turn, round after round: at least
    ``LEAST_ROUNDS`` rounds, and until each has had ``TIME_BUDGET`` seconds (at most 50
    rounds)."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    while len(next(iter(times.values()))) < LEAST_ROUNDS or (
        min(map(sum, times.values())) < TIME_BUDGET and len(times["dense"]) < 50
    ):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def path_timings(
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    ladder,
    density: float | None = None,
) -> list[dict]:
    """Per ``ladder`` token count, the wall times of the op's paths on a random served layer
    of the layout (``served_layer.random_served_layer``) and of dense ``F.linear`` on its
    weight: ``{name}_rounds``, each round's time, and ``{name}_s``, their median
    (``tokens``: the count)."""
    dense, layer = random_served_layer(out_features, in_features, dtype, density)
    paths = {path: PathThresholds.only(path) for path in _measured_paths(dtype, density)}
    timings = []
    with torch.no_grad():
        for tokens in ladder:
            x = torch.randn(tokens, in_features).to(dtype)
            fns = {"dense": lambda x=x: F.linear(x, dense)}
            fns |= {
                path: lambda x=x, thresholds=thresholds: layer.linear(x, None, thresholds)
                for path, thresholds in paths.items()
            }
            timings.append(timed_point(tokens, fns))
    return timings


def timed_point(tokens: int, fns: dict) -> dict:
    """A ladder point: ``fns`` timed in turn (``rounds_in_turn``), each one's rounds
    (``{name}_rounds``) and their median (``{name}_s``)."""
    rounds = rounds_in_turn(fns)
    return (
        {"tokens": tokens}
        | {f"{name}_s": statistics.median(r) for name, r in rounds.items()}
        | {f"{name}_rounds": r for name, r in rounds.items()}
    )
