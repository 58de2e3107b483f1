"""The compressed 2:4 layout: half the values plus a bitmask (4 bits per group of four).

Tensor layout of compressed-tensors' legacy ``sparse-24-bitmask`` format (what
compressed-tensors < 0.15 wrote), per 2:4 Linear ``NAME``:

* ``NAME.compressed``: the two kept values of every group of four consecutive inputs,
  row-major, ``[out, in / 2]``, in the weight's dtype;
* ``NAME.bitmask``: which inputs are kept, one bit per input, packed eight to a byte
  with the lowest bit first (``numpy.packbits(..., bitorder="little")``),
  ``[out, ceil(in / 8)]`` uint8;
* ``NAME.shape``: ``[[out], [in]]``.

Exactly two positions per group are marked: the nonzeros, padded with the first zero
positions where a group has fewer than two nonzeros, so ``decompress_24`` returns the
weight exactly.  Pure torch: this module is imported by the vLLM plugin too.
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

__all__ = ["NotTwoFourError", "check_compressed", "check_two_four", "compress_24", "decompress_24"]


class NotTwoFourError(ValueError):
    """A tensor that is not exactly 2:4 (or cannot be split into groups of four)."""


def check_two_four(weight: torch.Tensor, name: str) -> None:
    """Raise ``NotTwoFourError`` naming ``name`` unless every group of four consecutive
    inputs of every row of ``weight`` has at least two zeros."""
    if weight.dim() != 2 or weight.shape[1] % 4:
        raise NotTwoFourError(
            f"{name}: shape {tuple(weight.shape)} has no groups of four inputs (2:4 needs a "
            "2-D weight whose input size is a multiple of 4)"
        )
    nonzeros = nonzero(weight).reshape(weight.shape[0], -1, 4).sum(-1)
    if (nonzeros > 2).any():
        rows, groups = (nonzeros > 2).nonzero(as_tuple=True)
        raise NotTwoFourError(
            f"{name} is not exactly 2:4: {len(rows)} of {nonzeros.numel()} groups of four "
            f"hold more than two nonzeros (first: row {int(rows[0])}, inputs "
            f"{4 * int(groups[0])}..{4 * int(groups[0]) + 3})"
        )


def compress_24(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(compressed, bitmask)`` of an exactly 2:4 ``weight`` (``check_two_four`` first),
    in any dtype (float, int8, float8: the kept values are copied bit for bit)."""
    check_two_four(weight, name)
    rows, columns = weight.shape
    groups = nonzero(weight).reshape(rows, -1, 4)
    # two marks per group: nonzeros first, then the first zeros (a stable sort of ~mask)
    order = torch.sort((~groups).to(torch.int8), dim=-1, stable=True).indices[..., :2]
    mask = torch.zeros_like(groups).scatter_(-1, order, True).reshape(rows, columns)
    return weight[mask].reshape(rows, columns // 2), pack_bits(mask)


def decompress_24(
    compressed: torch.Tensor, bitmask: torch.Tensor, shape: tuple[int, int], name: str = "weight"
) -> torch.Tensor:
    """The dense ``[out, in]`` weight of ``compress_24``'s output, after
    ``check_compressed`` (every loader goes through here, so none can misread a layer)."""
    check_compressed(compressed, bitmask, shape, name)
    rows, columns = int(shape[0]), int(shape[1])
    mask = unpack_bits(bitmask, columns)
    dense = torch.zeros(rows, columns, dtype=compressed.dtype, device=compressed.device)
    dense[mask] = compressed.reshape(-1)
    return dense


def _nibble_table(high_marks: int | None) -> torch.Tensor:
    """Per byte value: two marks in its low nibble and ``high_marks`` in its high one
    (``None``: two, as in a full byte; ``0``: none, the padding of a last half byte)."""
    ones = [bin(value).count("1") for value in range(16)]
    return torch.tensor(
        [
            ones[b & 15] == 2 and (ones[b >> 4] == 2 if high_marks is None else b >> 4 == 0)
            for b in range(256)
        ]
    )


_FULL_BYTE, _LAST_HALF_BYTE = _nibble_table(None), _nibble_table(0)


def check_compressed(compressed, bitmask, shape, name: str = "weight") -> None:
    """Check a stored 2:4 layer ``name`` in one table look-up per bitmask byte (a byte
    holds two groups of four inputs): the shapes agree with ``shape``, every group marks
    exactly two inputs, and the padding bits are clear, so the marks are exactly
    ``compressed``'s values. Raises ``CorruptCheckpointError`` naming the layer and the
    tensor (``compressed`` is read for its shape only: a meta tensor will do)."""
    rows, columns = int(shape[0]), int(shape[1])
    check_part_shapes(
        name,
        shape,
        {
            "bitmask": (bitmask, (rows, -(-columns // 8))),
            "compressed": (compressed, (rows, columns // 2)),
        },
        " (inputs a multiple of 4)",
        holdable=columns % 4 == 0,
    )
    values = bitmask.to(torch.long)
    full = columns // 8
    valid = _FULL_BYTE.to(bitmask.device)[values[:, :full]].all()
    if columns % 8:  # the last byte holds one group and four padding bits
        valid &= _LAST_HALF_BYTE.to(bitmask.device)[values[:, full]].all()
    if not valid:
        raise CorruptCheckpointError(_bad_groups(bitmask, columns, name))


def _bad_groups(bitmask: torch.Tensor, columns: int, name: str) -> str:
    """Where a bitmask breaks 2:4 (the slow path, for the message only)."""
    bits = unpack_bits(bitmask, bitmask.shape[1] * 8)
    if bits[:, columns:].any():
        return f"{name}.bitmask marks inputs past {columns}; the checkpoint is corrupt"
    marks = bits[:, :columns].reshape(bits.shape[0], -1, 4).sum(-1)
    row, group = (marks != 2).nonzero()[0].tolist()
    return (
        f"{name}.bitmask is not 2:4: {int((marks != 2).sum())} of {marks.numel()} groups of "
        f"four mark other than two inputs (first: row {row}, inputs {4 * group}.."
        f"{4 * group + 3} mark {int(marks[row, group])}); the checkpoint is corrupt"
    )
