"""The unstructured layout (``whisper_sparse.format.bitmask``): compressed-tensors' legacy
``sparse-bitmask`` tensors, a round trip bit for bit, and every corruption refused, naming
the layer and the tensor, before any weight is used."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from whisper_sparse.format.bitmask import (
    bitmask_bytes,
    check_bitmask,
    compress_bitmask,
    decompress_bitmask,
)
from whisper_sparse.format.bits import CorruptCheckpointError


def sparse_weight(rows: int, columns: int, sparsity: float, dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator)
    weight[torch.rand(rows, columns, generator=generator) < sparsity] = 0
    weight[0] = 0  # a row with nothing kept
    weight[-1] = torch.randn(columns, generator=generator) + 5  # a row with everything kept
    return weight.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(5, 12), (7, 37), (16, 64), (3, 1)])
def test_round_trip_is_bit_for_bit_in_the_legacy_tensors(dtype, shape):
    weight = sparse_weight(*shape, 0.65, dtype)
    compressed, bitmask, row_offsets = compress_bitmask(weight)
    kept = (weight.float() != 0).numpy()
    assert np.array_equal(bitmask.numpy(), np.packbits(kept, axis=1, bitorder="little"))
    counts = kept.sum(axis=1)
    assert row_offsets.tolist() == (np.cumsum(counts) - counts).tolist()
    assert compressed.dim() == 1 and compressed.numel() == kept.sum()
    dense = decompress_bitmask(compressed, bitmask, row_offsets, shape, "layer")
    assert torch.equal(dense.view(torch.uint8), weight.view(torch.uint8))


def test_a_layer_takes_the_bytes_the_issue_counts():
    """bfloat16 at sparsity s: (1 - s) * 2 + 1/8 bytes per weight, plus 8 per row."""
    weight = sparse_weight(256, 4096, 0.65, torch.bfloat16)
    compressed, bitmask, row_offsets = compress_bitmask(weight)
    stored = sum(t.numel() * t.element_size() for t in (compressed, bitmask, row_offsets)) + 16
    assert stored == bitmask_bytes(256, 4096, compressed.numel(), 2)
    assert 0.40 < stored / (256 * 4096 * 2) < 0.43


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda c, b, o: (c, b, o[:-1]), r"layer\.row_offsets has shape \(6,\)"),
        (lambda c, b, o: (c[:-1], b, o), r"layer\.compressed holds \d+ values, but"),
        (
            lambda c, b, o: (
                c,
                b.clone().index_put_((torch.tensor(2), torch.tensor(0)), b[2, 0] ^ 1),
                o,
            ),
            r"layer\.(row_offsets\[3\] is|compressed holds)",
        ),
        (
            lambda c, b, o: (
                c,
                b.clone().index_put_(
                    (torch.tensor(1), torch.tensor(4)), torch.tensor(0x80, dtype=torch.uint8)
                ),
                o,
            ),
            r"layer\.bitmask marks inputs past 37",
        ),
        (lambda c, b, o: (c.reshape(1, -1), b, o), r"layer\.compressed has shape .* not 1-D"),
        (lambda c, b, o: (c, b.to(torch.int16), o), r"layer\.bitmask is torch\.int16"),
    ],
)
def test_a_corrupt_layer_is_refused_naming_it(corrupt, message):
    weight = sparse_weight(7, 37, 0.5, torch.bfloat16)
    parts = corrupt(*compress_bitmask(weight))
    with pytest.raises(CorruptCheckpointError, match=message):
        check_bitmask(*parts, (7, 37), "layer")
    with pytest.raises(CorruptCheckpointError):
        decompress_bitmask(*parts, (7, 37), "layer")
