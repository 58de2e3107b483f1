"""2:4 sparse GEMMs on sm80+ GPUs (cuSPARSELt, through torch), with a measured dispatch.

A Linear layer computes ``y = x Wᵀ (+ b)`` for tokens ``x`` (T, in). Here ``W`` (out, in),
2:4 along the inputs, is cuSPARSELt's sparse operand ``A`` (``torch._cslt_compress``), and
the dense operand is ``B = xᵀ`` taken as a *view* of ``x`` (column-major, no copy). With
``transpose_result=True`` cuSPARSELt writes ``(A B)ᵀ = x Wᵀ`` as a row-major (T, out)
tensor: the call needs no transpose of ``x`` or of ``y`` (measured on an H100 with torch
2.11 / cuSPARSELt: as fast as the plain (out, T) result, and ~2× faster than a drop-in
that transposes the result back). Token counts are padded to a multiple of 8, the dense
operand's granularity, and the padding rows are cut off the result (a contiguous row
slice).

The sparse GEMM loses to dense below a few hundred tokens (decode), so a
``DispatchPlan`` measured once per GPU, dtype and weight shape (at load time, cached on
disk) says from which token count the sparse kernel runs and with which cuSPARSELt
algorithm per token range; below it the dense weight runs. ``torch.cuda`` graph capture
never measures: plans are made before, and a shape without a plan runs dense.

The op is ``torch.ops.whisper_modifiers.sparse24_linear`` (a ``torch.library`` custom
op, so ``torch.compile`` and vLLM's compiled graphs keep it whole). Anywhere the sparse
kernel cannot run (CPU, float32, no cuSPARSELt, a shape it refuses), it is exactly
``F.linear`` with the dense weight.

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

from whisper_modifiers.sparse_serving.format import NotTwoFourError, check_two_four
from whisper_modifiers.sparse_serving.paths import cache_dir

__all__ = [
    "TOKEN_LADDER",
    "DispatchPlan",
    "FusedSparse24Linear",
    "Sparse24Linear",
    "accelerate",
    "measure_plan",
    "plan_for",
    "sparse24_linear",
    "serving_kernel",
    "sparse_kernel_available",
]

TOKEN_LADDER = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Token counts a plan is measured at; a count between two points uses the lower one's."""

SPARSE_MARGIN = 0.98
"""The sparse kernel runs only where it took at most this fraction of dense's time."""

_ROW_GRANULARITY = 8  # cuSPARSELt's dense operand: 16-bit dims in multiples of 8
_WEIGHT_GRANULARITY = 16  # its sparse operand: 16-bit dims in multiples of 16
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
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


def _ladder_index(ladder, tokens: int) -> int:
    index = 0
    for i, point in enumerate(ladder):
        if point <= tokens:
            index = i
    return index


def _dispatch(tokens: int, sparse_from: int, ladder, algorithms) -> int | None:
    """The cuSPARSELt algorithm for ``tokens``, or None for dense."""
    if tokens < sparse_from:
        return None
    return algorithms[_ladder_index(ladder, tokens)]


def sparse_kernel_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether cuSPARSELt 2:4 GEMMs run for ``dtype`` on ``device`` (CUDA, sm80+)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in _KERNEL_DTYPES or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return bool(torch.backends.cusparselt.is_available())


def _kernel_shape_ok(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return out_features % _WEIGHT_GRANULARITY == 0 and in_features % _WEIGHT_GRANULARITY == 0


def _pad_rows(x2d: torch.Tensor) -> torch.Tensor:
    missing = -x2d.shape[0] % _ROW_GRANULARITY
    return F.pad(x2d, (0, 0, 0, missing)) if missing else x2d


def _sparse_matmul(compressed: torch.Tensor, x2d: torch.Tensor, algorithm: int) -> torch.Tensor:
    """``x2d Wᵀ`` (tokens, out) for tokens padded to the granularity: ``A = W`` sparse,
    ``B = x2dᵀ`` a column-major view, the result written transposed (row-major)."""
    return torch._cslt_sparse_mm(compressed, x2d.t(), transpose_result=True, alg_id=algorithm)


def _sparse24_linear(x, compressed, dense, bias, out_features, sparse_from, ladder, algorithms):
    leading = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    tokens = x2d.shape[0]
    algorithm = None if compressed is None else _dispatch(tokens, sparse_from, ladder, algorithms)
    if algorithm is None:
        if dense is None:
            raise RuntimeError("sparse24_linear: no dense weight to run below the plan")
        return F.linear(x, dense, bias)
    y = _sparse_matmul(compressed, _pad_rows(x2d), algorithm)[:tokens]
    if bias is not None:
        y = y + bias
    return y.reshape(*leading, out_features)


@torch.library.custom_op("whisper_modifiers::sparse24_linear", mutates_args=())
def sparse24_linear(
    x: torch.Tensor,
    compressed: torch.Tensor | None,
    dense: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    sparse_from: int,
    ladder: list[int],
    algorithms: list[int],
) -> torch.Tensor:
    """``x Wᵀ + b`` for a 2:4 ``W``: cuSPARSELt's GEMM on ``compressed`` where the plan
    (``sparse_from``, ``ladder``, ``algorithms``; see ``DispatchPlan``) says so, else
    ``F.linear`` on ``dense``."""
    return _sparse24_linear(
        x, compressed, dense, bias, out_features, sparse_from, ladder, algorithms
    )


@sparse24_linear.register_fake
def _(x, compressed, dense, bias, out_features, sparse_from, ladder, algorithms):
    return x.new_empty(*x.shape[:-1], out_features)


# ---- measuring plans -------------------------------------------------------------------


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
        padded = _pad_rows(x)
        algorithm = torch._cslt_sparse_mm_search(compressed, padded.t(), transpose_result=True)
        dense_ms = _gpu_milliseconds(lambda: F.linear(x, dense))  # noqa: B023
        sparse_ms = _gpu_milliseconds(
            lambda: _sparse_matmul(compressed, _pad_rows(x), algorithm)[:tokens]  # noqa: B023
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


# ---- modules ---------------------------------------------------------------------------


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
        if sparse_kernel_available(weight.device, weight.dtype) and _kernel_shape_ok(weight):
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


KERNEL_MODE_VARIABLE = "WHISPER_MODIFIERS_SPARSE24"
KERNEL_MODES = ("auto", "sparse", "dense")


def kernel_mode() -> str:
    """``$WHISPER_MODIFIERS_SPARSE24``: ``auto`` (default; sparse where measured faster,
    dense below, keeping the dense weight too), ``sparse`` (always sparse, the compressed
    weight alone) or ``dense`` (no sparse kernel)."""
    mode = os.environ.get(KERNEL_MODE_VARIABLE, "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNEL_MODE_VARIABLE}={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    return mode


def serving_kernel(weight: torch.Tensor) -> Sparse24Linear | None:
    """The kernel a server uses for a loaded 2:4 ``weight``, by ``kernel_mode()``; None
    where it would only run dense (CPU, float32, ``dense``)."""
    mode = kernel_mode()
    if mode == "dense" or not (
        sparse_kernel_available(weight.device, weight.dtype) and _kernel_shape_ok(weight)
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
