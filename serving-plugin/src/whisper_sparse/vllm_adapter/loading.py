"""Loading a compressed layer's tensors in vLLM, and taking them back after loading.

A 2:4 layer's ``compressed`` / ``bitmask`` / ``shape`` parameters are registered on the
layer with vLLM's own weight loaders (merged layers and tensor-parallel shards load as the
dense weight would), each stored tensor checked as it loads; an unstructured layer's are
``bitmask_loading``'s. ``take_stored`` gives this rank's checked tensors of either,
``dense_of`` the dense weight. ``vllm_adapter.layers``' linear methods call these.

Imports only torch and this package's format.
"""

from __future__ import annotations

import torch

from whisper_sparse.format.bits import CorruptCheckpointError
from whisper_sparse.format.declaration import BITMASK_FORMAT
from whisper_sparse.format.layout import decompress_stored
from whisper_sparse.vllm_adapter.bitmask_loading import (
    register_bitmask,
    take_bitmask,
)

__all__ = [
    "check_stored_rows",
    "dense_of",
    "register_compressed",
    "take_dense_weight",
    "take_stored",
]


def register_compressed(
    layer,
    name,
    format,
    input_size_per_partition,
    input_size,
    rows,
    dtype,
    weight_loader,
    extra_weight_attrs,
) -> None:
    """The stored tensors of a layer in ``format`` as parameters of ``layer``."""
    layer.sparse_format = format
    register = register_bitmask if format == BITMASK_FORMAT else _register_two_four
    register(
        layer,
        name,
        input_size_per_partition,
        input_size,
        rows,
        dtype,
        weight_loader,
        extra_weight_attrs,
    )


def _register_two_four(
    layer,
    name,
    input_size_per_partition,
    input_size,
    rows,
    dtype,
    weight_loader,
    extra_weight_attrs,
) -> None:
    """``compressed`` / ``bitmask`` / ``shape`` parameters on ``layer``, loaded by vLLM's
    own (v1) loader of the layer: rows are outputs, so merged and column shards are row
    ranges, and a row-parallel shard narrows the columns (whole groups and bytes only)."""
    if input_size % 4:
        raise ValueError(
            f"{name}: {input_size} inputs are not a multiple of 4, so the layer cannot be "
            "2:4; the checkpoint's targets are wrong"
        )
    if input_size_per_partition != input_size and input_size_per_partition % 8:
        raise ValueError(
            f"{name}: its tensor-parallel shard holds {input_size_per_partition} of "
            f"{input_size} inputs, which splits groups of four (or bitmask bytes) of the "
            "compressed 2:4 weight; use a tensor-parallel size that divides the input size "
            "into multiples of 8"
        )
    layer.sparse_stored_rows = {}  # (part, checkpoint part) -> rows, checked after loading
    for part, columns, part_dtype in (
        ("compressed", input_size_per_partition // 2, dtype),
        ("bitmask", -(-input_size_per_partition // 8), torch.uint8),  # whole bytes per row
    ):
        parameter = torch.nn.Parameter(
            torch.empty(rows, columns, dtype=part_dtype), requires_grad=False
        )
        layer.register_parameter(part, parameter)
        parameter.output_dim, parameter.input_dim = 0, 1
        stored_columns = input_size // 2 if part == "compressed" else -(-input_size // 8)
        parameter.weight_loader = _checked_loader(layer, part, stored_columns, weight_loader)
        for key, value in extra_weight_attrs.items():
            setattr(parameter, key, value)
    shape = torch.nn.Parameter(torch.empty(2, 1, dtype=torch.int64), requires_grad=False)
    shape.weight_loader = _checked_loader(layer, "shape", 1, None)  # known from the layer
    layer.register_parameter("shape", shape)
    layer.sparse_dense_shape = (rows, input_size_per_partition)
    layer.sparse_input_size = input_size
    layer.sparse_name = name


def _checked_loader(layer, part, columns, weight_loader):
    """``weight_loader`` (vLLM's own, of the layer) for the checkpoint tensor ``part``,
    after checking its columns (the layer's whole input size, compressed), so a tensor of
    the wrong shape is an error naming the layer and the tensor rather than vLLM's bare
    ``AssertionError``. The rows of every stored tensor are recorded by checkpoint part
    (``q``/``k``/``v``, gate/up, or the whole layer) and compared in ``check_stored_rows``."""

    def load(param, loaded_weight, shard=None, *args, **kwargs):
        name = f"{layer.sparse_name}.{part}" + ("" if shard is None else f" (part {shard})")
        if part == "shape":
            stored = loaded_weight.reshape(-1).tolist()
            if len(stored) != 2 or stored[1] != layer.sparse_input_size:
                raise CorruptCheckpointError(
                    f"{name} is {stored}: the layer has {layer.sparse_input_size} inputs"
                )
            layer.sparse_stored_rows[(part, shard)] = stored[0]
            return
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != columns:
            raise CorruptCheckpointError(
                f"{name} has shape {list(loaded_weight.shape)}; the layer's "
                f"{layer.sparse_input_size} inputs need [rows, {columns}]"
            )
        layer.sparse_stored_rows[(part, shard)] = loaded_weight.shape[0]
        try:
            weight_loader(
                param, loaded_weight, *(() if shard is None else (shard,)), *args, **kwargs
            )
        except AssertionError as error:  # vLLM's shape assertion, on the rows
            raise CorruptCheckpointError(
                f"{name} has shape {list(loaded_weight.shape)}, which does not fit the "
                f"layer's {list(param.shape)}"
            ) from error

    return load


def check_stored_rows(layer) -> None:
    """Every checkpoint part's ``compressed``, ``bitmask`` and ``shape`` agree on its rows."""
    by_shard: dict = {}
    for (part, shard), rows in layer.sparse_stored_rows.items():
        by_shard.setdefault(shard, {})[part] = rows
    for shard, rows in by_shard.items():
        if len(set(rows.values())) != 1 or len(rows) != 3:
            suffix = "" if shard is None else f" (part {shard})"
            raise CorruptCheckpointError(
                f"{layer.sparse_name}{suffix}: the stored compressed / bitmask / shape "
                f"tensors disagree on the rows or one is missing: {rows}"
            )


def take_stored(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's checked ``(compressed, bitmask, row_offsets)`` of a loaded layer
    (``row_offsets`` None for 2:4); the stored tensors leave the layer."""
    if layer.sparse_format == BITMASK_FORMAT:
        return take_bitmask(layer)
    check_stored_rows(layer)
    stored = (layer.compressed.data, layer.bitmask.data, None)
    for part in ("compressed", "bitmask", "shape"):
        delattr(layer, part)
    return stored


def dense_of(stored, shape, name: str = "weight") -> torch.Tensor:
    """The dense weight (in the dtype it was stored in) of ``take_stored``'s tensors."""
    return decompress_stored(*stored, shape, name)


def take_dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The dense weight of a loaded layer; its stored tensors leave it."""
    return dense_of(take_stored(layer), layer.sparse_dense_shape, layer.sparse_name)
