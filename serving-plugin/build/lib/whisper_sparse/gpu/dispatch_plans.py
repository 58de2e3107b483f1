"""Where the 2:4 GEMM beats dense: ``DispatchPlan``s measured once per GPU, torch,
cuSPARSELt, dtype and weight shape (at load time, cached on disk).

The sparse GEMM loses to dense below a few hundred tokens (decode), so a plan says from
which token count the sparse kernel runs and with which cuSPARSELt algorithm per token
range; below it the dense weight runs. ``torch.cuda`` graph capture never measures:
plans are made before, and a shape without a plan runs dense.

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from whisper_sparse.gpu.sparse_op import pad_rows, sparse_matmul
from whisper_sparse.paths import cache_dir

__all__ = [
    "DENSE_ONLY",
    "SPARSE_MARGIN",
    "TOKEN_LADDER",
    "DispatchPlan",
    "measure_plan",
    "plan_cache_file",
    "plan_for",
    "plan_from_timings",
]

TOKEN_LADDER = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Token counts a plan is measured at; a count between two points uses the lower one's."""

SPARSE_MARGIN = 0.98
"""The sparse kernel runs only where it took at most this fraction of dense's time."""

_NEVER = 1 << 62


@dataclass(frozen=True)
class DispatchPlan:
    """Where the sparse kernel runs: for ``tokens >= sparse_from``, with cuSPARSELt
    algorithm ``algorithms[i]`` for the ladder range ``[ladder[i], ladder[i + 1])``."""

    sparse_from: int
    ladder: tuple[int, ...]
    algorithms: tuple[int, ...]

    @classmethod
    def always_sparse(cls, plan: DispatchPlan | None = None) -> DispatchPlan:
        if plan is None:
            return cls(1, (1,), (0,))
        return cls(1, plan.ladder, plan.algorithms)

    def uses_dense(self) -> bool:
        return self.sparse_from > 1


DENSE_ONLY = DispatchPlan(_NEVER, (1,), (0,))
"""The plan of a layer the sparse kernel cannot run (CPU, float32, a refused shape)."""


def _gpu_milliseconds(fn, repeats: int = 10, trials: int = 5) -> float:
    """Median GPU time of ``fn`` (a CUDA graph of ``repeats`` calls, replayed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    del graph
    return statistics.median(times)


def measure_plan(
    compressed: torch.Tensor, dense: torch.Tensor, ladder=TOKEN_LADDER, margin=SPARSE_MARGIN
) -> tuple[DispatchPlan, list[dict]]:
    """Time dense against sparse (with cuSPARSELt's best algorithm, searched per point)
    at each ladder token count; sparse runs from the lowest point at and above which it
    always took at most ``margin`` of dense's time. Returns the plan and the timings."""
    timings = []
    in_features = dense.shape[1]
    for tokens in ladder:
        x = torch.randn(tokens, in_features, device=dense.device, dtype=dense.dtype)
        padded = pad_rows(x)
        algorithm = torch._cslt_sparse_mm_search(compressed, padded.t(), transpose_result=True)
        dense_ms = _gpu_milliseconds(lambda: F.linear(x, dense))  # noqa: B023
        sparse_ms = _gpu_milliseconds(
            lambda: sparse_matmul(compressed, pad_rows(x), algorithm)[:tokens]  # noqa: B023
        )
        timings.append(
            {
                "tokens": tokens,
                "algorithm": int(algorithm),
                "dense_ms": dense_ms,
                "sparse_ms": sparse_ms,
            }
        )
    return plan_from_timings(timings, margin), timings


def plan_from_timings(timings: list[dict], margin: float = SPARSE_MARGIN) -> DispatchPlan:
    """The plan a measured table gives: sparse from the lowest token count at and above
    which the sparse kernel always took at most ``margin`` of dense's time (so a count
    where dense measured faster, and every count below it, runs dense)."""
    sparse_from = _NEVER
    for row in sorted(timings, key=lambda r: r["tokens"], reverse=True):
        if row["sparse_ms"] > margin * row["dense_ms"]:
            break
        sparse_from = row["tokens"]
    rows = sorted(timings, key=lambda r: r["tokens"])
    return DispatchPlan(
        sparse_from, tuple(r["tokens"] for r in rows), tuple(r["algorithm"] for r in rows)
    )


def plan_cache_file() -> Path:
    """``sparse24_plans.json`` in the package's cache (``paths.cache_dir``)."""
    return cache_dir() / "sparse24_plans.json"


_plans: dict[str, DispatchPlan] = {}
_plans_lock = threading.Lock()


def _plan_key(dense: torch.Tensor) -> str:
    device = dense.device
    return "|".join(
        (
            torch.cuda.get_device_name(device),
            torch.__version__,
            str(torch.backends.cusparselt.version()),
            str(dense.dtype).removeprefix("torch."),
            "x".join(map(str, dense.shape)),
        )
    )


def plan_for(compressed: torch.Tensor, dense: torch.Tensor) -> DispatchPlan:
    """The plan for this GPU, torch, cuSPARSELt, dtype and weight shape: from memory, the
    cache file, or measured now (and saved). Never measures inside graph capture."""
    key = _plan_key(dense)
    with _plans_lock:
        if key in _plans:
            return _plans[key]
        path = plan_cache_file()
        stored = _read_plans(path)
        if key in stored:
            plan = DispatchPlan(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in stored[key].items()}
            )
        else:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a 2:4 dispatch plan cannot be measured during graph capture")
            plan, _ = measure_plan(compressed, dense)
            stored = _read_plans(path)
            stored[key] = asdict(plan)
            _write_plans(path, stored)
        _plans[key] = plan
        return plan


def _read_plans(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_plans(path: Path, plans: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(plans, indent=1, sort_keys=True))
        partial.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a measurement next time
