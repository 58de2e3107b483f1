"""Compressed sparse checkpoints on disk: a saved checkpoint's Linear weights rewritten in
``two_four``'s layout or ``bitmask``'s and declared in ``config.json`` (``declaration``),
every stored layer checked before any weight loads, and the checkpoint read back in the
dense layout.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from whisper_sparse.format.bitmask import (
    BITMASK_PARTS,
    bitmask_bytes,
    check_bitmask,
    compress_bitmask,
    decompress_bitmask,
)
from whisper_sparse.format.bits import CorruptCheckpointError, nonzero
from whisper_sparse.format.declaration import (
    BITMASK_FORMAT,
    STOCK_LOADER_GUARD,
    STOCK_LOADER_GUARDS,
    TWO_FOUR_FORMAT,
    declaration,
)
from whisper_sparse.format.two_four import (
    check_compressed,
    compress_24,
    decompress_24,
)

__all__ = [
    "QUANTIZED_FORMATS",
    "StoredLayer",
    "add_loader_guard",
    "check_stored",
    "decompress_stored",
    "dequantize",
    "verify_compressed_layers",
    "weight_files",
    "write_compressed",
    "write_dense_layout",
]

PARTS = {TWO_FOUR_FORMAT: ("compressed", "bitmask", "shape"), BITMASK_FORMAT: BITMASK_PARTS}
_REWRITTEN = ("config.json", "model.safetensors.index.json")
# compressed-tensors formats storing one quantized value per weight (W8A8, FP8_DYNAMIC)
QUANTIZED_FORMATS = ("int-quantized", "float-quantized")


@dataclass(frozen=True)
class StoredLayer:
    """A compressed Linear as a checkpoint stores it: its layout, ``[out, in]`` and the
    number of values ``compressed`` holds."""

    format: str
    shape: tuple[int, int]
    values: int


def check_stored(compressed, bitmask, row_offsets, shape, name: str = "weight") -> None:
    """Check a stored layer in its layout: ``bitmask``'s where it has ``row_offsets``
    (``check_bitmask``), else ``two_four``'s (``check_compressed``)."""
    if row_offsets is None:
        check_compressed(compressed, bitmask, shape, name)
    else:
        check_bitmask(compressed, bitmask, row_offsets, shape, name)


def decompress_stored(compressed, bitmask, row_offsets, shape, name: str = "weight"):
    """The dense ``[out, in]`` weight of a stored layer in its layout (``row_offsets`` None
    for a 2:4 layer), checked first as ``check_stored`` checks it."""
    if row_offsets is None:
        return decompress_24(compressed, bitmask, shape, name)
    return decompress_bitmask(compressed, bitmask, row_offsets, shape, name)


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [directory / "model.safetensors"]


def verify_compressed_layers(
    files, expected_shapes: dict | None = None, declared: dict | None = None
) -> dict[str, StoredLayer]:
    """Check every compressed layer stored in the safetensors ``files`` before any weight
    is loaded: a layer with ``row_offsets`` in ``bitmask``'s layout (``check_bitmask``),
    any other in ``two_four``'s (``check_compressed``); its ``.shape`` against
    ``expected_shapes`` (layer name -> ``(out, in)``, from the model's config) and its
    layout against ``declared`` (layer name -> format, from ``config.json``; every
    declared layer must be stored so) where given. Reads the bitmasks, offsets and
    ``.shape`` tensors, and only the headers of ``.compressed``. Raises
    ``CorruptCheckpointError`` naming the layer and the tensor; returns the layers."""
    with contextlib.ExitStack() as stack:
        where = {}
        for path in map(Path, files):
            try:
                handle = stack.enter_context(safe_open(path, "pt"))
            except Exception as error:  # safetensors' own error names no file
                raise CorruptCheckpointError(f"{path} cannot be read: {error}") from error
            where.update(dict.fromkeys(handle.keys(), handle))
        names = sorted(key[: -len(".bitmask")] for key in where if key.endswith(".bitmask"))
        layers = {name: _verified(where, name, (expected_shapes or {}).get(name)) for name in names}
    for name, format in (declared or {}).items():
        stored = layers.get(name)
        if stored is None or stored.format != format:
            raise CorruptCheckpointError(
                f"{name}: config.json declares it {format}, but the checkpoint stores "
                f"{'it dense' if stored is None else stored.format}"
            )
    return layers


def _verified(where: dict, name: str, expected) -> StoredLayer:
    def tensor(part):
        return where[f"{name}.{part}"].get_tensor(f"{name}.{part}")

    format = BITMASK_FORMAT if f"{name}.row_offsets" in where else TWO_FOUR_FORMAT
    missing = [f"{name}.{part}" for part in PARTS[format] if f"{name}.{part}" not in where]
    if missing:
        raise CorruptCheckpointError(f"{name}: {', '.join(missing)} missing")
    shape = tensor("shape").reshape(-1).tolist()
    if len(shape) != 2 or (expected is not None and tuple(shape) != tuple(expected)):
        raise CorruptCheckpointError(
            f"{name}.shape holds {shape}, but the model's config makes the layer "
            f"{list(expected) if expected is not None else '[out, in]'}"
        )
    key = f"{name}.compressed"
    compressed = torch.empty(where[key].get_slice(key).get_shape(), device="meta")
    row_offsets = tensor("row_offsets") if format == BITMASK_FORMAT else None
    check_stored(compressed, tensor("bitmask"), row_offsets, shape, name)
    return StoredLayer(format, (int(shape[0]), int(shape[1])), compressed.numel())


def add_loader_guard(directory: str | Path) -> None:
    """Write ``transformers_weights: STOCK_LOADER_GUARD`` into ``directory``'s
    ``config.json`` (the guard of the module docstring)."""
    config_path = Path(directory) / "config.json"
    config = json.loads(config_path.read_text())
    config["transformers_weights"] = STOCK_LOADER_GUARD
    config_path.write_text(json.dumps(config, indent=2))


def write_compressed(
    directory: str | Path, two_four: list[str], unstructured: list[str] = ()
) -> dict:
    """Rewrite the saved checkpoint in ``directory``: the ``NAME.weight`` of every
    ``two_four`` layer in ``two_four``'s layout (one that is not exactly 2:4 raises
    ``NotTwoFourError`` naming it, before anything is written), of every ``unstructured``
    one in ``bitmask``'s layout where that is smaller than the dense weight (in a quantized
    chain always: every quantized layer is stored compressed), declared in ``config.json``
    (nothing is declared where no layer was compressed). Returns the layers by layout
    (``two_four``, ``bitmask``, ``kept_dense``), the compressed layers' ``dense_bytes`` and
    ``compressed_bytes``, and the weight files' ``checkpoint_bytes`` and
    ``dense_checkpoint_bytes`` (what they hold in the dense layout)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    quantization = config.get("quantization_config")
    if quantization and quantization.get("format") not in QUANTIZED_FORMATS:
        raise ValueError(
            f"{directory} is quantized in compressed-tensors' {quantization.get('format')!r} "
            f"format; the compressed sparse layouts hold unquantized weights or the "
            f"{' / '.join(QUANTIZED_FORMATS)} ones (one value per weight)"
        )
    wanted = {f"{name}.weight": (name, TWO_FOUR_FORMAT) for name in two_four}
    wanted |= {f"{name}.weight": (name, BITMASK_FORMAT) for name in unstructured}
    files, stored = _compress_files(directory, wanted, always=bool(quantization))
    missing = sorted(set(wanted) - {f"{name}.weight" for name in stored})
    if missing:
        raise ValueError(f"{directory} has no tensor {missing[0]} (of {len(missing)} targets)")
    for path, (tensors, metadata) in files.items():
        save_file(tensors, path, metadata=metadata or {"format": "pt"})
    by_format = {
        format: sorted(name for name, (f, _) in stored.items() if f == format)
        for format in (TWO_FOUR_FORMAT, BITMASK_FORMAT, None)
    }
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        for name, (format, _) in stored.items():
            if format is not None:
                shard = weight_map.pop(f"{name}.weight")
                weight_map.update({f"{name}.{part}": shard for part in PARTS[format]})
        index.write_text(json.dumps(data, indent=2))
    if by_format[TWO_FOUR_FORMAT] or by_format[BITMASK_FORMAT]:
        config["quantization_config"] = declaration(
            by_format[TWO_FOUR_FORMAT], by_format[BITMASK_FORMAT], quantization
        )
        config["transformers_weights"] = STOCK_LOADER_GUARD
        config_path.write_text(json.dumps(config, indent=2))
    return _sizes(files, stored) | {
        "two_four": by_format[TWO_FOUR_FORMAT],
        "bitmask": by_format[BITMASK_FORMAT],
        "kept_dense": by_format[None],
    }


def _sizes(files: dict, stored: dict) -> dict:
    """Bytes of the compressed layers (dense and as stored) and of the weight files."""

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    checkpoint = sum(size(tensors.values()) for tensors, _ in files.values())
    dense = sum(d for f, d in stored.values() if f is not None)
    compressed = sum(
        size(tensors[f"{name}.{part}"] for part in PARTS[f])
        for tensors, _ in files.values()
        for name, (f, _) in stored.items()
        if f is not None and f"{name}.compressed" in tensors
    )
    return {
        "dense_bytes": dense,
        "compressed_bytes": compressed,
        "checkpoint_bytes": checkpoint,
        "dense_checkpoint_bytes": checkpoint - compressed + dense,
    }


def _compress_files(directory: Path, wanted: dict, always: bool):
    """Every weight file of ``directory`` in memory with the ``wanted`` weights
    (``NAME.weight`` -> ``(NAME, format)``) compressed, before anything is written (a
    bitmask layer only where smaller, unless ``always``): ``({path: (tensors, metadata)},
    {NAME: (the format stored, None where kept dense; its dense bytes)})``."""
    files, stored = {}, {}
    for path in weight_files(directory):  # compress everything first, then write
        tensors, metadata = {}, None
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata()
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                base = key[: -len(".weight_scale")]
                if key.endswith(".weight_scale") and f"{base}.weight" not in wanted:
                    raise ValueError(
                        f"{base} is quantized but not pruned: every quantized layer of a "
                        "compressed sparse checkpoint must be compressed"
                    )
                if key not in wanted:
                    tensors[key] = tensor
                    continue
                name, format = wanted[key]
                parts = _compressed_parts(tensor, name, format, always)
                tensors |= parts or {key: tensor}
                stored[name] = (format if parts else None, tensor.numel() * tensor.element_size())
        files[path] = (tensors, metadata)
    return files, stored


def _compressed_parts(weight: torch.Tensor, name: str, format: str, always: bool) -> dict | None:
    """``NAME.part`` -> tensor of ``weight`` in ``format``; None for a bitmask layer that
    would not be smaller than dense (unless ``always``)."""
    shape = torch.tensor(list(weight.shape)).reshape(-1, 1)
    if format == TWO_FOUR_FORMAT:
        compressed, bitmask = compress_24(weight, name)
        return {
            f"{name}.compressed": compressed,
            f"{name}.bitmask": bitmask,
            f"{name}.shape": shape,
        }
    rows, columns = weight.shape
    kept = int(nonzero(weight).sum())
    if not always and bitmask_bytes(rows, columns, kept, weight.element_size()) >= (
        weight.numel() * weight.element_size()
    ):
        return None
    compressed, bitmask, row_offsets = compress_bitmask(weight)
    return {
        f"{name}.compressed": compressed,
        f"{name}.bitmask": bitmask,
        f"{name}.row_offsets": row_offsets,
        f"{name}.shape": shape,
    }


def write_dense_layout(source: str | Path, target: str | Path) -> Path:
    """A copy of the compressed checkpoint ``source`` in the dense layout, in ``target``:
    compressed weights decompressed to ``NAME.weight`` (quantized values stay quantized, scales
    as they are), ``config.json``'s quantization config the nested compressed-tensors one
    (or none). Other files are linked. What compressed-tensors and transformers load
    natively, activation quantization included."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    files = weight_files(source)
    for path in source.iterdir():
        if path.is_file() and path not in files and path.name not in _REWRITTEN:
            (target / path.name).symlink_to(path.resolve())
    weight_map = {}
    for path in files:
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata()
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        for key in [k for k in tensors if k.endswith(".compressed")]:
            name = key[: -len(".compressed")]
            shape = tensors.pop(f"{name}.shape").reshape(-1).tolist()
            tensors[f"{name}.weight"] = decompress_stored(
                tensors.pop(key),
                tensors.pop(f"{name}.bitmask"),
                tensors.pop(f"{name}.row_offsets", None),
                shape,
                name,
            )
        save_file(tensors, target / path.name, metadata=metadata or {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    index = source / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = weight_map
        (target / index.name).write_text(json.dumps(data, indent=2))
    config = json.loads((source / "config.json").read_text())
    if config.get("transformers_weights") in STOCK_LOADER_GUARDS:
        del config["transformers_weights"]
    quantization = config.pop("quantization_config", None) or {}
    if quantization.get("quantization_config"):
        config["quantization_config"] = quantization["quantization_config"]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A symmetric int8/float8 weight times its per-channel or per-tensor scale
    (compressed-tensors' ``(q - 0) * scale`` in the scale's dtype); ``weight`` itself
    when ``scale`` is None."""
    return weight if scale is None else weight.to(scale.dtype) * scale
