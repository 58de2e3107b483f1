"""Where the 2:4 CPU op pays off: a ``CpuPlan`` per layer shape and dtype, measured once per
CPU, build of the op (its sources, torch, compiler), kernel set and thread count, and cached
on disk (as ``dispatch_plans`` does for GPUs).

Two things are measured on a random 2:4 weight of the layer's shape, at each
``TOKEN_LADDER`` count: the op's row kernels against its tiled path (which token count the
tiles take over from: ``tiled_from``), and the op against the dense ``F.linear`` of the
same weight at one token (``faster_at_decode``: where the op loses there, the ``auto``
kernel mode serves the layer dense, decompressed).

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from whisper_modifiers.sparse_serving.cpu_build import loaded_build_key
from whisper_modifiers.sparse_serving.cpu_op import NO_TILES, cpu_isa, sparse24_cpu_linear
from whisper_modifiers.sparse_serving.format import compress_24
from whisper_modifiers.sparse_serving.paths import cache_dir, write_json_atomically

__all__ = ["TOKEN_LADDER", "CpuPlan", "cpu_plan", "measure_cpu_plan", "plan_from_timings"]

TOKEN_LADDER = (1, 4, 16, 64, 256)
TIME_BUDGET = 0.2  # seconds of runs per measured point (at least 3 runs)
PLAN_VERSION = 1


@dataclass(frozen=True)
class CpuPlan:
    """``tiled_from``: the token count from which the op runs its tiled path;
    ``faster_at_decode``: whether the op beat dense at one token."""

    tiled_from: int
    faster_at_decode: bool


def random_two_four(rows: int, columns: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random exactly 2:4 weight (the two largest of every four kept)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator).to(dtype)
    groups = weight.reshape(rows, -1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.abs().topk(2, dim=-1).indices, True)
    return (groups * keep).reshape(rows, columns)


def _seconds(fn) -> float:
    """Median wall time of ``fn`` over at least 3 runs and ``TIME_BUDGET`` seconds."""
    fn()  # warm-up
    times = []
    while len(times) < 3 or (sum(times) < TIME_BUDGET and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cpu_plan(out_features: int, in_features: int, dtype: torch.dtype,
                     ladder=TOKEN_LADDER) -> tuple[CpuPlan, list[dict]]:  # fmt: skip
    """Time the op's row kernels, its tiled path and dense ``F.linear`` at each ladder
    token count on a random 2:4 weight; the plan and the timings."""
    dense = random_two_four(out_features, in_features, dtype)
    compressed, bitmask = compress_24(dense)
    timings = []
    with torch.no_grad():
        for tokens in ladder:
            x = torch.randn(tokens, in_features).to(dtype)

            def op(tiled_from: int, x=x):
                return sparse24_cpu_linear(x, compressed, bitmask, None, in_features, tiled_from)

            timings.append({
                "tokens": tokens,
                "rows_s": _seconds(lambda: op(NO_TILES)),
                "tiles_s": _seconds(lambda: op(0)),
                "dense_s": _seconds(lambda x=x: F.linear(x, dense)),
            })  # fmt: skip
    return plan_from_timings(timings), timings


def plan_from_timings(timings: list[dict]) -> CpuPlan:
    """Tiles from the lowest ladder point at and above which they were never slower than
    the row kernels; the op against dense at the first point (one token)."""
    tiled_from = NO_TILES
    for timing in reversed(timings):
        if timing["tiles_s"] > timing["rows_s"]:
            break
        tiled_from = timing["tokens"]
    first = timings[0]
    op = first["tiles_s"] if first["tokens"] >= tiled_from else first["rows_s"]
    return CpuPlan(tiled_from, op <= first["dense_s"])


_lock = threading.Lock()
_known: dict[str, CpuPlan] = {}


def _cpu_key() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    lines = [line for line in cpuinfo.splitlines() if line.startswith(("model name", "flags"))]
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()[:16]


def plan_cache_file() -> Path:
    return cache_dir() / "cpu_plans.json"


def cpu_plan(out_features: int, in_features: int, dtype: torch.dtype) -> CpuPlan:
    """The plan of a layer shape and dtype here: from memory, from the cache file, or
    measured now (a few seconds for a 7B-sized layer) and added to the file."""
    key = "|".join(
        map(
            str,
            (
                PLAN_VERSION,
                _cpu_key(),
                loaded_build_key(),
                cpu_isa(),
                torch.get_num_threads(),
                dtype,
                out_features,
                in_features,
            ),
        )
    )
    with _lock:
        if key in _known:
            return _known[key]
        path = plan_cache_file()
        stored = json.loads(path.read_text()) if path.is_file() else {}
        if key in stored:
            plan = CpuPlan(**stored[key]["plan"])
        else:
            plan, timings = measure_cpu_plan(out_features, in_features, dtype)
            stored = json.loads(path.read_text()) if path.is_file() else {}
            stored[key] = {"plan": asdict(plan), "timings": timings}
            write_json_atomically(path, stored)
        _known[key] = plan
        return plan
