"""What a served model's compressed layers hold for their weights, against the dense bytes.

cuSPARSELt's compressed 16-bit operand (``torch._cslt_compress``) takes 9/16 of the dense
weight; a layer that also keeps the dense weight (the ``auto`` kernel mode on a GPU, to run
dense below its plan's crossover) holds 1 + 9/16 of it. The CPU op's layers hold the
checkpoint's ``compressed`` and ``bitmask`` tensors: 9/16 of a bfloat16 weight, 17/32 of a
float32 one; an unstructured layer's op also its ``row_offsets`` (0.41x a bfloat16 weight
at 65 %) and, where its rows are spread in memory (``cpu.row_spread``), the gaps between
them; in the grouped layout (``cpu.grouped_layout``), its group masks and offsets instead of
the bitmask and row offsets. The W8A8 op's layers (``w8a8_op``) hold their stored int8
values, bitmask and row offsets: 5/8 of the dense int8 weight at 2:4.
``sparse_weight_bytes`` walks a model (vLLM's, through ``LLM.apply_model``, or one
``gpu.kernels.accelerate`` changed) and counts, per compressed layer, every distinct tensor
storage it keeps for its weight: the ``weight`` parameter, the kernel's compressed operand
and its dense copy (a tensor shared by two of them is counted once).

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import torch

from whisper_sparse.cpu.linear import CpuSparseLinear
from whisper_sparse.gpu.kernels import Sparse24Linear

__all__ = ["DENSE_BYTES_ATTRIBUTE", "layer_weight_bytes", "sparse_weight_bytes"]

DENSE_BYTES_ATTRIBUTE = "sparse_dense_bytes"
"""Set by the vLLM plugin on each compressed layer it loads: the bytes of its dense weight."""


def _storages(tensors) -> dict[int, int]:
    """Distinct storages of ``tensors`` (None skipped): data pointer → bytes."""
    held = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        held[storage.data_ptr()] = storage.nbytes()
    return held


def layer_weight_bytes(layer: torch.nn.Module) -> tuple[int | None, int]:
    """``(held, dense)``: the bytes ``layer`` keeps for its compressed weight and the bytes
    of that weight dense. A ``Sparse24Linear`` or ``CpuSparseLinear`` (or a layer with one
    as ``sparse_kernel``, or with the W8A8 op as ``w8a8_op``) holds its compressed
    tensors and, where its plan runs dense, the dense copy; any other layer holds its
    ``weight``. ``held`` is None where the weight left the layer's tensors (vLLM's CPU
    GEMMs pack it into a oneDNN handle and leave an empty ``weight``)."""
    kernel = getattr(layer, "sparse_kernel", None) or getattr(layer, "w8a8_op", None) or layer
    weight = getattr(layer, "weight", None)
    compressed = getattr(kernel, "compressed", getattr(kernel, "values", None))
    dense_copy = getattr(kernel, "dense", None)
    bitmask = getattr(kernel, "bitmask", None)  # the CPU op's (cuSPARSELt's is inside)
    row_offsets = getattr(kernel, "row_offsets", None)  # an unstructured layer's
    grouped = [getattr(kernel, name, None) for name in ("group_masks", "group_offsets")]
    held = _storages([weight, compressed, dense_copy, bitmask, row_offsets, *grouped])
    packed = compressed is None and dense_copy is None and (weight is None or weight.numel() == 0)
    dense = getattr(layer, DENSE_BYTES_ATTRIBUTE, None)
    if dense is None:
        full = weight if weight is not None else dense_copy
        if full is None:
            dense = kernel.out_features * kernel.in_features * compressed.dtype.itemsize
        else:
            dense = full.numel() * full.element_size()
    return (None if packed else sum(held.values())), int(dense)


def sparse_weight_bytes(model: torch.nn.Module) -> dict:
    """``{"layers", "held_bytes", "dense_bytes", "ratio", "packed_layers"}`` over the
    compressed layers of ``model``: those the vLLM plugin marked (``DENSE_BYTES_ATTRIBUTE``,
    with their kernel if any) and every other module of the kinds above.
    ``ratio`` is held / dense: 1.0 for dense weights, 0.5625 for a 16-bit compressed
    weight alone (cuSPARSELt's operand, or the CPU op's tensors), 1.5625 with the dense
    copy beside it; None where some layer's weight is packed out of sight
    (``packed_layers``, see ``layer_weight_bytes``) or there is no compressed layer."""
    marked = [m for m in model.modules() if hasattr(m, DENSE_BYTES_ATTRIBUTE)]
    inside = {id(getattr(m, "sparse_kernel", None)) for m in marked}
    kinds = (Sparse24Linear, CpuSparseLinear)
    kernels = [m for m in model.modules() if isinstance(m, kinds) and id(m) not in inside]
    held = dense = packed = 0
    for layer in marked + kernels:
        layer_held, layer_dense = layer_weight_bytes(layer)
        packed += layer_held is None
        held, dense = held + (layer_held or 0), dense + layer_dense
    ratio = held / dense if dense and not packed else None
    return {
        "layers": len(marked) + len(kernels),
        "held_bytes": held,
        "dense_bytes": dense,
        "ratio": ratio,
        "packed_layers": packed,
    }
