"""What both compressed layouts share: the bitmask (one bit per input, lowest bit first),
what counts as a kept value, the shape check of a stored layer's tensors, and the error a
stored layer that fails its checks raises. Pure torch."""

from __future__ import annotations

import torch

__all__ = ["CorruptCheckpointError", "check_part_shapes", "nonzero", "pack_bits", "unpack_bits"]

_BITS = 1 << torch.arange(8, dtype=torch.int32)  # bit i of a byte is column 8j + i


class CorruptCheckpointError(ValueError):
    """A stored compressed layer whose tensors disagree (a truncated or altered checkpoint)."""


def nonzero(weight: torch.Tensor) -> torch.Tensor:
    """``weight != 0``, for float8 too (compared on its bytes, ``-0.0`` counting as 0)."""
    if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (weight.view(torch.uint8) & 0x7F) != 0
    return weight != 0


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``[rows, columns]`` bool to ``[rows, ceil(columns / 8)]`` uint8, lowest bit first."""
    rows, columns = mask.shape
    padded = torch.zeros(rows, -(-columns // 8) * 8, dtype=torch.int32, device=mask.device)
    padded[:, :columns] = mask.to(torch.int32)
    return (padded.reshape(rows, -1, 8) * _BITS.to(mask.device)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """The inverse of ``pack_bits``: ``[rows, columns]`` bool."""
    bits = (packed.to(torch.int32).unsqueeze(-1) & _BITS.to(packed.device)) != 0
    return bits.reshape(packed.shape[0], -1)[:, :columns]


def check_part_shapes(name: str, shape, parts: dict, note: str = "", holdable: bool = True) -> None:
    """Raise ``CorruptCheckpointError`` naming the first of a stored layer's ``parts``
    (part -> ``(tensor, expected shape)``) whose shape is not the one the layer's ``shape``
    needs (``note`` says what the layout needs of it), or the first part where the layout
    cannot hold a layer of that ``shape`` at all (not ``holdable``); a bitmask that is not
    uint8 too."""
    rows, columns = int(shape[0]), int(shape[1])
    for part, (tensor, expected) in parts.items():
        if not holdable or tuple(tensor.shape) != tuple(expected):
            raise CorruptCheckpointError(
                f"{name}.{part} has shape {tuple(tensor.shape)}, but {name}.shape "
                f"[{rows}, {columns}] needs {tuple(expected)}{note}; the checkpoint is "
                "truncated or corrupt"
            )
    bitmask = parts.get("bitmask", (None,))[0]
    if bitmask is not None and bitmask.dtype != torch.uint8:
        raise CorruptCheckpointError(f"{name}.bitmask is {bitmask.dtype}, not uint8")
