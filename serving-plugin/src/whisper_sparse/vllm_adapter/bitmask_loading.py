"""Loading an unstructured layer's stored tensors in vLLM (``format.bitmask``'s layout).

Its values are one ragged 1-D tensor per stored part (``q_proj``, ``k_proj``, ``v_proj``;
``gate_proj``, ``up_proj``; or the whole layer), which no vLLM weight loader can shard.
So each stored part's tensors are kept as they load, and vLLM's own loader of the layer,
run on two stand-ins (every stored row's index, and the number of its part), says which
stored rows this rank's layer holds and where: merged layers, column shards and replicated
key/value heads come out as vLLM places a dense weight's rows. After loading, every stored
part is checked (``check_bitmask``), and the rank's rows (of a row-parallel shard, its
columns) are laid out again in the same layout. Any split of the inputs works: the
layout has no groups to keep whole.

Imports only torch and this package's format.
"""

from __future__ import annotations

import torch

from whisper_sparse.format.bitmask import (
    BITMASK_PARTS,
    check_bitmask,
    compress_bitmask,
    decompress_bitmask,
    row_counts,
)
from whisper_sparse.format.bits import CorruptCheckpointError

__all__ = ["register_bitmask", "take_bitmask"]


def register_bitmask(
    layer,
    name,
    input_size_per_partition,
    input_size,
    rows,
    dtype,
    weight_loader,
    extra_weight_attrs,
) -> None:
    """Placeholder ``compressed`` / ``bitmask`` / ``row_offsets`` / ``shape`` parameters on
    ``layer`` whose loaders keep each stored part's tensors, and the two stand-ins (not
    parameters: the checkpoint has no such tensors) that vLLM's ``weight_loader`` fills."""
    layer.sparse_stored = {}  # checkpoint part (shard id, None for a whole layer) -> tensors
    layer.sparse_part_numbers = {}  # checkpoint part -> its number in the stand-in
    layer.sparse_row_source = {
        "row": torch.full((rows,), -1, dtype=torch.int64),
        "part": torch.full((rows,), -1, dtype=torch.int64),
    }
    for stand_in in layer.sparse_row_source.values():
        stand_in.output_dim = 0
    dtypes = {"compressed": dtype, "bitmask": torch.uint8}  # offsets and shape: int64
    for part in BITMASK_PARTS:
        parameter = torch.nn.Parameter(
            torch.empty(0, dtype=dtypes.get(part, torch.int64)), requires_grad=False
        )
        layer.register_parameter(part, parameter)
        for key, value in extra_weight_attrs.items():
            setattr(parameter, key, value)
        parameter.weight_loader = _keeping_loader(layer, part, weight_loader)
    layer.sparse_dense_shape = (rows, input_size_per_partition)
    layer.sparse_input_size = input_size
    layer.sparse_values_dtype = dtype
    layer.sparse_name = name


def _keeping_loader(layer, part, weight_loader):
    """Keep the stored tensor ``part`` of one checkpoint part; for its ``row_offsets`` (one
    per stored row), run vLLM's ``weight_loader`` on the stand-ins."""

    def load(param, loaded_weight, shard=None, *args, **kwargs):
        label = f"{layer.sparse_name}.{part}" + ("" if shard is None else f" (part {shard})")
        layer.sparse_stored.setdefault(shard, {})[part] = loaded_weight
        if part != "row_offsets":
            return
        number = layer.sparse_part_numbers.setdefault(shard, len(layer.sparse_part_numbers))
        stored_rows = loaded_weight.shape[0]
        fills = {"row": torch.arange(stored_rows), "part": torch.full((stored_rows,), number)}
        for key, stand_in in layer.sparse_row_source.items():
            try:
                weight_loader(
                    stand_in, fills[key], *(() if shard is None else (shard,)), *args, **kwargs
                )
            except AssertionError as error:  # vLLM's shape assertion, on the rows
                raise CorruptCheckpointError(
                    f"{label} has {stored_rows} rows, which do not fit the layer's "
                    f"{layer.sparse_dense_shape[0]}"
                ) from error

    return load


def take_bitmask(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``(values, bitmask, row_offsets)`` of a loaded unstructured layer, every
    stored part checked first; the stored tensors and placeholders leave the layer."""
    name = layer.sparse_name
    for shard, parts in layer.sparse_stored.items():
        label = name + ("" if shard is None else f" (part {shard})")
        missing = [part for part in BITMASK_PARTS if part not in parts]
        if missing:
            raise CorruptCheckpointError(f"{label}: {', '.join(missing)} missing")
        shape = parts["shape"].reshape(-1).tolist()
        if len(shape) != 2 or shape[1] != layer.sparse_input_size:
            raise CorruptCheckpointError(
                f"{label}.shape is {shape}: the layer has {layer.sparse_input_size} inputs"
            )
        check_bitmask(parts["compressed"], parts["bitmask"], parts["row_offsets"], shape, label)
    rows, parts_of_rows = layer.sparse_row_source["row"], layer.sparse_row_source["part"]
    if (parts_of_rows < 0).any():
        first = int((parts_of_rows < 0).nonzero()[0])
        raise CorruptCheckpointError(f"{name}: row {first} of the layer is not in the checkpoint")
    numbers = {
        number: layer.sparse_stored[shard] for shard, number in layer.sparse_part_numbers.items()
    }
    values, bitmask, row_offsets = _placed_rows(numbers, rows, parts_of_rows)
    values = values.to(layer.sparse_values_dtype)
    out_rows, columns = layer.sparse_dense_shape
    if columns != layer.sparse_input_size:  # a row-parallel shard: this rank's inputs
        start = layer.tp_rank * columns
        dense = decompress_bitmask(
            values, bitmask, row_offsets, (out_rows, layer.sparse_input_size), name
        )
        values, bitmask, row_offsets = compress_bitmask(dense[:, start : start + columns])
    for part in BITMASK_PARTS:
        delattr(layer, part)
    del layer.sparse_stored, layer.sparse_row_source
    return values, bitmask, row_offsets


def _placed_rows(stored: dict, rows: torch.Tensor, parts_of_rows: torch.Tensor):
    """The layout of the layer whose row ``r`` is stored row ``rows[r]`` of stored part
    ``parts_of_rows[r]`` (``stored``: part number -> its tensors), all inputs kept."""
    bitmask = None
    counts = torch.zeros(rows.shape[0], dtype=torch.int64)
    picked = {}
    for number, parts in stored.items():
        where = (parts_of_rows == number).nonzero().squeeze(1)
        source = rows[where]
        part_bitmask = parts["bitmask"]
        if bitmask is None:
            bitmask = torch.zeros(rows.shape[0], part_bitmask.shape[1], dtype=torch.uint8)
        bitmask[where] = part_bitmask[source]
        counts[where] = row_counts(part_bitmask[source])
        starts = parts["row_offsets"].to(torch.int64)[source]
        picked[number] = (where, parts["compressed"][_ranges(starts, counts[where])])
    row_offsets = torch.cumsum(counts, 0) - counts
    values = None
    for where, part_values in picked.values():
        if values is None:
            values = torch.empty(int(counts.sum()), dtype=part_values.dtype)
        values[_ranges(row_offsets[where], counts[where])] = part_values
    return values, bitmask, row_offsets


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The indices ``starts[i] .. starts[i] + counts[i] - 1`` of every ``i``, in order."""
    firsts = torch.cumsum(counts, 0) - counts
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(firsts, counts)
    return torch.repeat_interleave(starts, counts) + within
