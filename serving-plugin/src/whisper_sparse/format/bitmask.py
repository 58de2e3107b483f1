"""The compressed layout of unstructured sparse weights: each row's nonzeros packed, one bit
per input, and where each row's values start.

Tensor layout of compressed-tensors' legacy ``sparse-bitmask`` format (what
compressed-tensors < 0.15 wrote for unstructured sparsity), per sparse Linear ``NAME``:

* ``NAME.compressed``: the kept values of every row, row after row, 1-D, in the weight's
  dtype (a row's values in input order);
* ``NAME.bitmask``: which inputs are kept, one bit per input, eight to a byte, lowest bit
  first (``bits.pack_bits``), ``[out, ceil(in / 8)]`` uint8;
* ``NAME.row_offsets``: where each row's values start in ``compressed`` (the exclusive
  cumulative sum of the rows' counts), ``[out]`` int64;
* ``NAME.shape``: ``[[out], [in]]``.

In bfloat16 a weight at sparsity ``s`` takes ``(1 - s) * 2 + 1/8`` bytes, plus 8 per row:
0.5625x dense at 50 %, 0.41x at 65 % (``bitmask_bytes``). Pure torch: the vLLM plugin
imports this module too.
"""

from __future__ import annotations

import torch

from whisper_sparse.format.bits import (
    CorruptCheckpointError,
    check_part_shapes,
    nonzero,
    pack_bits,
    unpack_bits,
)

__all__ = [
    "BITMASK_PARTS",
    "bitmask_bytes",
    "check_bitmask",
    "compress_bitmask",
    "decompress_bitmask",
    "row_counts",
]

BITMASK_PARTS = ("compressed", "bitmask", "row_offsets", "shape")
_POPCOUNT = torch.tensor([bin(byte).count("1") for byte in range(256)], dtype=torch.int64)


def bitmask_bytes(rows: int, columns: int, kept: int, itemsize: int) -> int:
    """The bytes of a layer in this layout: its kept values, bitmask, offsets and shape."""
    return kept * itemsize + rows * (-(-columns // 8)) + rows * 8 + 2 * 8


def row_counts(bitmask: torch.Tensor) -> torch.Tensor:
    """How many values each row of ``bitmask`` keeps (int64, one per row)."""
    return _POPCOUNT.to(bitmask.device)[bitmask.to(torch.int64)].sum(dim=1)


def compress_bitmask(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(compressed, bitmask, row_offsets)`` of a 2-D ``weight``: its nonzeros (``-0.0``
    counts as zero) row after row, bit for bit, in any dtype."""
    if weight.dim() != 2:
        raise ValueError(f"a sparse weight is 2-D [out, in]; got shape {tuple(weight.shape)}")
    kept = nonzero(weight)
    counts = kept.sum(dim=1, dtype=torch.int64)
    row_offsets = torch.cumsum(counts, 0) - counts
    return weight[kept], pack_bits(kept), row_offsets


def check_bitmask(compressed, bitmask, row_offsets, shape, name: str = "weight") -> None:
    """Check a stored sparse layer ``name`` before it loads: the tensors' shapes agree with
    ``shape``, the padding bits past the inputs are clear, ``row_offsets`` are the
    exclusive cumulative sum of the bitmask's rows' counts, and ``compressed`` holds exactly
    the marked values. Raises ``CorruptCheckpointError`` naming the layer and the tensor
    (``compressed`` is read for its shape only: a meta tensor will do)."""
    rows, columns = int(shape[0]), int(shape[1])
    check_part_shapes(
        name,
        shape,
        {"bitmask": (bitmask, (rows, -(-columns // 8))), "row_offsets": (row_offsets, (rows,))},
    )
    if row_offsets.dtype not in (torch.int32, torch.int64):
        raise CorruptCheckpointError(f"{name}.row_offsets is {row_offsets.dtype}, not int64")
    if compressed.dim() != 1:
        raise CorruptCheckpointError(
            f"{name}.compressed has shape {tuple(compressed.shape)}, not 1-D; the checkpoint "
            "is corrupt"
        )
    if columns % 8 and rows and (bitmask[:, -1] >> (columns % 8)).any():
        raise CorruptCheckpointError(f"{name}.bitmask marks inputs past {columns}; corrupt")
    counts = row_counts(bitmask)
    starts = torch.cumsum(counts, 0) - counts
    if not torch.equal(row_offsets.to(torch.int64), starts.to(row_offsets.device)):
        row = int((row_offsets.to(torch.int64) != starts.to(row_offsets.device)).nonzero()[0])
        raise CorruptCheckpointError(
            f"{name}.row_offsets[{row}] is {int(row_offsets[row])}, but the bitmask's rows "
            f"before it mark {int(starts[row])} values; the checkpoint is corrupt"
        )
    total = int(counts.sum())
    if compressed.numel() != total:
        raise CorruptCheckpointError(
            f"{name}.compressed holds {compressed.numel()} values, but {name}.bitmask marks "
            f"{total}; the checkpoint is truncated or corrupt"
        )


def decompress_bitmask(compressed, bitmask, row_offsets, shape, name: str = "weight"):
    """The dense ``[out, in]`` weight, after ``check_bitmask`` (every loader goes through
    here)."""
    check_bitmask(compressed, bitmask, row_offsets, shape, name)
    rows, columns = int(shape[0]), int(shape[1])
    dense = torch.zeros(rows, columns, dtype=compressed.dtype, device=compressed.device)
    bits = torch.uint8 if compressed.element_size() == 1 else compressed.dtype  # float8: bytes
    dense.view(bits)[unpack_bits(bitmask, columns)] = compressed.view(bits)
    return dense
