"""Where the CPU op pays off: a ``CpuPlan`` per layer shape, dtype and layout (2:4, or
unstructured at a density rounded to ``DENSITY_STEP``), measured once per CPU, build of the
op (its sources, torch, compiler), kernel set and thread count, and cached on disk (as
``gpu.dispatch_plans`` does for GPUs).

On a random served layer of the shape and layout (``plan_timing``), at each
``TOKEN_LADDER`` count, the op's ``PATHS`` are timed against each other and against the
dense ``F.linear`` of the same weight: its row kernels, its GEMM (2:4 or unstructured;
``gemm_runs``: bfloat16 on ``avx512_bf16`` kernels; for a 2:4 layer, also the unstructured
GEMM over its rows, "lanes") and its tiles (ATen's GEMM on expanded tiles; on AMX, also
blocks expanded once through the op's AMX tiles, "brgemm"). The plan runs each
token count on the path that won there (the tiles, which stand for oneDNN and so for AMX
where the CPU has it, must win by ``TILES_MARGIN``), and says whether the op beat dense at
one token (``faster_at_decode``: where it lost, the ``auto`` kernel mode serves the layer
dense, decompressed). The paths of a point and dense are timed in turn, round after round,
and two of them compare by the median of their rounds' ratios: a slow spell on a shared
machine then slows both sides of a ratio (benchmarks/results/JOURNAL.md, 2026-11-29).

A cache file that cannot be read (corrupt, truncated, another layout) is measured anew,
with one line of reason in the log.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from whisper_sparse.cpu.build import loaded_build_key
from whisper_sparse.cpu.cpu_info import cpu_identity
from whisper_sparse.cpu.op import NO_TILES, PathThresholds, cpu_isa
from whisper_sparse.cpu.plan_timing import path_timings
from whisper_sparse.mode import KERNEL_MODE_VARIABLE
from whisper_sparse.paths import cache_dir, write_json_atomically

__all__ = [
    "TOKEN_LADDER",
    "CpuPlan",
    "cpu_plan",
    "measure_cpu_plan",
    "first_of_winning_run",
    "plan_density",
    "plan_from_timings",
    "time_ratio",
]

logger = logging.getLogger(__name__)

# up to 512: a large x leaves the cache, and the tiles overtake the row kernels there
TOKEN_LADDER = (1, 4, 16, 32, 64, 256, 512)
TILES_MARGIN = 0.95  # the tiles take a token count only at or below this of the best time
PLAN_VERSION = 9  # a new version measures every plan anew
DENSITY_STEP = 0.05  # an unstructured layer's plan is measured at its density rounded to this


@dataclass(frozen=True, kw_only=True)
class CpuPlan(PathThresholds):
    """The op's path by token count (``PathThresholds``) as measured here;
    ``faster_at_decode``: whether the op beat dense at one token; ``speedups``: dense time /
    op time at each measured token count, as ``(tokens, ratio)`` pairs (for the log)."""

    faster_at_decode: bool = False
    speedups: tuple = ()

    def describe(self) -> str:
        """One line: the path of each token range and the speed against dense."""
        gemm_from = min(self.gemm_from, self.tiled_from)
        lanes_until = min(max(self.lanes_until, gemm_from), self.tiled_from)
        brgemm_until = max(self.brgemm_until, self.tiled_from)
        bounds = (
            ("rows", 1, gemm_from),
            ("lanes", gemm_from, lanes_until),
            ("gemm", lanes_until, self.tiled_from),
            ("brgemm tiles", self.tiled_from, brgemm_until),
            ("tiles", brgemm_until, None),
        )
        ranges = [
            f"{path} from {start}"
            for path, start, end in bounds
            if start < NO_TILES and (end is None or start < end)
        ]
        ratios = ", ".join(f"{ratio:.2f}x at {tokens}" for tokens, ratio in self.speedups)
        line = f"{'; '.join(ranges)} tokens"
        if ratios:
            line += f" (dense time / op time: {ratios})"
        return line + self._slower_than_dense()

    def _slower_than_dense(self) -> str:
        """Where the op lost to dense above one token (an AMX Xeon's batched steps: oneDNN's
        AMX GEMM reads a dense weight at one token's cost), the token counts and the way to
        serve dense; nothing elsewhere (one token decides ``auto``: ``faster_at_decode``)."""
        losses = [tokens for tokens, ratio in self.speedups if tokens > 1 and ratio < 1.0]
        if not losses:
            return ""
        return (
            f"; slower than dense at {', '.join(map(str, losses))} tokens: "
            f"{KERNEL_MODE_VARIABLE}=dense serves such layers decompressed, "
            "at the dense weights' memory"
        )


def plan_density(density: float | None) -> float | None:
    """An unstructured layer's density as its plan is measured (None: a 2:4 layer)."""
    return None if density is None else round(round(density / DENSITY_STEP) * DENSITY_STEP, 2)


def measure_cpu_plan(
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    ladder=TOKEN_LADDER,
    density: float | None = None,
) -> tuple[CpuPlan, list[dict]]:
    """Time the op's paths and dense ``F.linear`` at each ladder token count on a random
    weight of the layout (``plan_timing.path_timings``); the plan and the timings."""
    timings = path_timings(out_features, in_features, dtype, ladder, density)
    return plan_from_timings(timings), timings


def time_ratio(timing: dict, path: str, rival: str) -> float:
    """``path``'s time over ``rival``'s at a ladder point: the median over the rounds of each
    round's ratio where both were timed round by round (``{name}_rounds``; a slow spell on
    the shared machine then slows both sides of a ratio, where it could take one side's
    median alone), else the ratio of their medians."""
    mine, theirs = timing.get(f"{path}_rounds"), timing.get(f"{rival}_rounds")
    if mine and theirs and len(mine) == len(theirs):
        return statistics.median(m / t for m, t in zip(mine, theirs, strict=True))
    return timing[f"{path}_s"] / timing[f"{rival}_s"]


def first_of_winning_run(
    timings: list[dict], path: str, rivals: list[str], margin: float = 1.0
) -> int:
    """The lowest ladder count from which ``path`` took at most ``margin`` times the time
    of each of ``rivals`` at that count and every count above it (``time_ratio``;
    ``NO_TILES`` where it lost at the top)."""
    start = NO_TILES
    for timing in reversed(timings):
        if timing.get(f"{path}_s") is None:
            break
        if any(
            time_ratio(timing, path, rival) > margin
            for rival in rivals
            if timing.get(f"{rival}_s") is not None
        ):
            break
        start = timing["tokens"]
    return start


def _timed_as(timing: dict, path: str, source: str) -> dict:
    """A ladder point with ``source``'s times (median and rounds) standing for ``path``'s."""
    return timing | {
        f"{path}_s": timing[f"{source}_s"],
        f"{path}_rounds": timing.get(f"{source}_rounds"),
    }


def plan_from_timings(timings: list[dict]) -> CpuPlan:
    """Tiles from the lowest ladder count at and above which they took at most
    ``TILES_MARGIN`` of the row kernels' and the GEMMs' time; below that, a 2:4 layer's
    unstructured GEMM ("lanes") until the lowest count from which the 2:4 GEMM was never
    slower than it; the GEMM so chosen from the lowest count below the tiles from which it
    was never slower than the row kernels; the op, on its chosen path, against dense. Each
    count weighs the faster tiles, the micro-kernel's ("brgemm", where timed) or ATen's, and
    the tiles are ATen's from the lowest of their counts from which ATen's were never slower
    (``brgemm_until``: on an AMX Xeon each shape's winner can change with the count)."""
    faster_tiles = [
        _timed_as(t, "tiles", "brgemm")
        if t.get("brgemm_s") is not None and t["brgemm_s"] < t["tiles_s"]
        else t
        for t in timings
    ]
    tiled_from = first_of_winning_run(
        faster_tiles, "tiles", ["rows", "gemm", "lanes"], TILES_MARGIN
    )
    tiled = [t for t in timings if t["tokens"] >= tiled_from and t.get("brgemm_s") is not None]
    brgemm_until = first_of_winning_run(tiled, "tiles", ["brgemm"]) if tiled else 0
    below = [timing for timing in timings if timing["tokens"] < tiled_from]
    lanes_until = 0
    if below and any(timing.get("lanes_s") is not None for timing in below):
        lanes_until = first_of_winning_run(below, "gemm", ["lanes"])
    chosen = [
        _timed_as(timing, "gemm", "lanes") if timing["tokens"] < lanes_until else timing
        for timing in below
    ]
    gemm_from = first_of_winning_run(chosen, "gemm", ["rows"]) if below else NO_TILES
    paths = PathThresholds(
        gemm_from=gemm_from,
        tiled_from=tiled_from,
        lanes_until=lanes_until,
        brgemm_until=brgemm_until,
    )
    speedups = tuple(
        (t["tokens"], time_ratio(t, "dense", paths.path(t["tokens"]))) for t in timings
    )
    return CpuPlan(**asdict(paths), faster_at_decode=speedups[0][1] >= 1.0, speedups=speedups)


_lock = threading.Lock()
_known: dict[str, CpuPlan] = {}


def _cpu_key() -> str:
    return hashlib.sha256(cpu_identity().encode()).hexdigest()[:16]


def plan_cache_file() -> Path:
    return cache_dir() / "cpu_plans.json"


def _stored_plans(path: Path) -> dict:
    """The cache file's plans by key: empty where there is no file, and where it cannot be
    read (corrupt, truncated, another layout), said in one line, so that they are measured
    anew and the file written whole again."""
    if not path.is_file():
        return {}
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            raise ValueError(f"it holds a JSON {type(stored).__name__}, not an object")
        return stored
    except (OSError, UnicodeDecodeError, ValueError) as error:
        logger.warning("the CPU plan cache %s cannot be read (%s): measuring anew", path, error)
        return {}


def _stored_plan(entry) -> CpuPlan | None:
    """A cache entry's plan, or None where the entry is not one (then measured anew)."""
    try:
        fields = dict(entry["plan"])
        return CpuPlan(**{**fields, "speedups": tuple(map(tuple, fields["speedups"]))})
    except (KeyError, TypeError, ValueError) as error:
        logger.warning("a CPU plan cache entry cannot be read (%r): measuring anew", error)
        return None


def plan_key(out_features: int, in_features: int, dtype: torch.dtype, density: float | None) -> str:
    """A plan's key in the cache: the CPU, build, kernels and threads it was measured with,
    and the layer's shape, dtype and layout (``density`` as ``plan_density`` rounds it)."""
    layout = "2:4" if density is None else f"unstructured {density}"
    fields = (PLAN_VERSION, _cpu_key(), loaded_build_key(), cpu_isa(), torch.get_num_threads())
    return "|".join(map(str, (*fields, dtype, out_features, in_features, layout)))


def cpu_plan(
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    density: float | None = None,
    measure=None,
) -> CpuPlan:
    """The plan of a layer shape, dtype and layout (``density`` None: 2:4; else an
    unstructured layer's, rounded by ``plan_density``) here: from memory, from the cache
    file, or measured now (a few seconds for a 7B-sized layer) and added to the file.
    ``measure(density)``, where given, measures it instead of ``measure_cpu_plan`` (the W8A8
    op's plans, ``cpu.int8_serving``): ``(plan, timings)``."""
    density = plan_density(density)
    key = plan_key(out_features, in_features, dtype, density)
    with _lock:
        if key in _known:
            return _known[key]
        path = plan_cache_file()
        stored = _stored_plans(path)
        plan = _stored_plan(stored[key]) if key in stored else None
        if plan is None:
            if measure is None:
                plan, timings = measure_cpu_plan(out_features, in_features, dtype, density=density)
            else:
                plan, timings = measure(density)
            stored = _stored_plans(path)  # as other processes left it meanwhile
            stored[key] = {"plan": asdict(plan), "timings": timings}
            write_json_atomically(path, stored)
        _known[key] = plan
        return plan
