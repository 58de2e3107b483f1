"""The 2:4 sparse GEMM on sm80+ GPUs (cuSPARSELt, through torch) as one custom op.

A Linear layer computes ``y = x Wᵀ (+ b)`` for tokens ``x`` (T, in). Here ``W`` (out, in),
2:4 along the inputs, is cuSPARSELt's sparse operand ``A`` (``torch._cslt_compress``), and
the dense operand is ``B = xᵀ`` taken as a *view* of ``x`` (column-major, no copy). With
``transpose_result=True`` cuSPARSELt writes ``(A B)ᵀ = x Wᵀ`` as a row-major (T, out)
tensor: the call needs no transpose of ``x`` or of ``y`` (as fast as the plain (out, T)
result on an H100, and faster than transposing it back: benchmarks/results/JOURNAL.md).
Token counts are padded to a multiple of 8, the dense
operand's granularity, and the padding rows are cut off the result (a contiguous row
slice).

The op is ``torch.ops.whisper_modifiers.sparse24_linear`` (a ``torch.library`` custom
op, so ``torch.compile`` and vLLM's compiled graphs keep it whole). Which token counts run
sparse, and with which cuSPARSELt algorithm, are its arguments (a ``DispatchPlan``'s
numbers, ``gpu.dispatch_plans``); below the plan's threshold, or anywhere the sparse kernel
cannot run, it is exactly ``F.linear`` with the dense weight.

Imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "kernel_shape_ok",
    "pad_rows",
    "sparse24_linear",
    "sparse_kernel_available",
    "sparse_matmul",
]

_ROW_GRANULARITY = 8  # cuSPARSELt's dense operand: 16-bit dims in multiples of 8
_WEIGHT_GRANULARITY = 16  # its sparse operand: 16-bit dims in multiples of 16
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


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


def kernel_shape_ok(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return out_features % _WEIGHT_GRANULARITY == 0 and in_features % _WEIGHT_GRANULARITY == 0


def pad_rows(x2d: torch.Tensor) -> torch.Tensor:
    missing = -x2d.shape[0] % _ROW_GRANULARITY
    return F.pad(x2d, (0, 0, 0, missing)) if missing else x2d


def sparse_matmul(compressed: torch.Tensor, x2d: torch.Tensor, algorithm: int) -> torch.Tensor:
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
    y = sparse_matmul(compressed, pad_rows(x2d), algorithm)[:tokens]
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
