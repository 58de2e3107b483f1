"""The bytes a served model's 2:4 layers hold for their weights (whisper_sparse.weight_bytes):
what the GPU serving benchmark reports as "2:4 weights / dense"."""

from __future__ import annotations

import pytest
import torch

from whisper_sparse.gpu.kernels import Sparse24Linear
from whisper_sparse.weight_bytes import (
    DENSE_BYTES_ATTRIBUTE,
    layer_weight_bytes,
    sparse_weight_bytes,
)

OUT, IN = 32, 64


def two_four_weight(dtype=torch.bfloat16) -> torch.Tensor:
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).to(dtype)
    groups = weight.view(OUT, IN // 4, 4)
    groups[..., :2] = 0
    return weight


class StandInKernel(torch.nn.Module):
    """What the plugin attaches as ``sparse_kernel`` on a GPU: cuSPARSELt's compressed
    16-bit operand (9/16 of the dense bytes) and, in the auto mode, the dense copy."""

    def __init__(self, weight, keep_dense):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.compressed = torch.empty(weight.numel() * 9 // 16, dtype=weight.dtype)
        self.dense = weight if keep_dense else None


def served_layer(keep_dense: bool | None) -> torch.nn.Module:
    """A vLLM layer as the plugin leaves it: marked with its dense bytes; with a kernel
    (None: decompressed, vLLM's dense path), whose dense copy is the ``weight`` parameter."""
    weight = two_four_weight()
    layer = torch.nn.Module()
    setattr(layer, DENSE_BYTES_ATTRIBUTE, weight.numel() * weight.element_size())
    if keep_dense is None or keep_dense:
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if keep_dense is not None:
        layer.sparse_kernel = StandInKernel(weight, keep_dense)
    return layer


@pytest.mark.parametrize(("keep_dense", "ratio"), [(None, 1.0), (True, 1.5625), (False, 0.5625)])
def test_a_served_layer_counts_each_storage_it_holds_once(keep_dense, ratio):
    layer = served_layer(keep_dense)
    held, dense = layer_weight_bytes(layer)
    assert dense == OUT * IN * 2
    assert held == pytest.approx(ratio * dense)


def test_model_totals_count_a_kernel_inside_a_marked_layer_once():
    model = torch.nn.ModuleList([served_layer(True), served_layer(False), torch.nn.Linear(4, 4)])
    totals = sparse_weight_bytes(model)
    assert totals["layers"] == 2  # the plain Linear is no 2:4 layer
    assert totals["dense_bytes"] == 2 * OUT * IN * 2
    assert totals["ratio"] == pytest.approx((1.5625 + 0.5625) / 2)


def test_sparse24_linear_on_a_cpu_holds_its_dense_weight_once():
    """Where the kernel cannot run (CPU), the module keeps only the dense weight: 1.0×."""
    module = torch.nn.Sequential(Sparse24Linear(two_four_weight(torch.float32)))
    totals = sparse_weight_bytes(module)
    assert totals == {
        "layers": 1,
        "held_bytes": OUT * IN * 4,
        "dense_bytes": OUT * IN * 4,
        "ratio": 1.0,
        "packed_layers": 0,
    }


def test_a_weight_packed_out_of_sight_gives_no_ratio():
    """vLLM's CPU GEMMs move the weight into a oneDNN handle and leave an empty ``weight``:
    the bytes cannot be counted, and no ratio is claimed."""
    layer = served_layer(None)
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    assert layer_weight_bytes(layer) == (None, OUT * IN * 2)
    totals = sparse_weight_bytes(torch.nn.ModuleList([layer, served_layer(False)]))
    assert totals["packed_layers"] == 1 and totals["ratio"] is None


def test_a_model_without_two_four_layers_has_no_ratio():
    assert sparse_weight_bytes(torch.nn.Linear(4, 4))["ratio"] is None


def test_a_compressed_only_kernel_reads_its_dense_bytes_from_its_shape():
    """A ``Sparse24Linear`` that dropped its dense weight (always sparse, on a GPU) and no
    plugin mark: the dense bytes come from its features and the compressed operand's dtype."""
    kernel = StandInKernel(two_four_weight(), keep_dense=False)
    assert layer_weight_bytes(kernel) == (OUT * IN * 2 * 9 // 16, OUT * IN * 2)


class StandInW8A8Op:
    """What the plugin attaches as ``w8a8_op`` to a compressed W8A8 layer on a CPU: the 2:4
    layout's stored int8 values (half the weight) and its bitmask (one bit per weight)."""

    def __init__(self):
        self.values = torch.zeros(OUT, IN // 2, dtype=torch.int8)
        self.bitmask = torch.zeros(OUT, IN // 8, dtype=torch.uint8)
        self.row_offsets = None


def test_a_w8a8_op_layer_holds_five_eighths_of_its_dense_int8_weight():
    layer = torch.nn.Module()
    setattr(layer, DENSE_BYTES_ATTRIBUTE, OUT * IN)  # int8: a byte a weight
    layer.w8a8_op = StandInW8A8Op()
    assert layer_weight_bytes(layer) == (OUT * IN * 5 // 8, OUT * IN)
    assert sparse_weight_bytes(torch.nn.ModuleList([layer]))["ratio"] == 0.625
