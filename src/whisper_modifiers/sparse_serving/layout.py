"""Compressed 2:4 checkpoints on disk (``format``'s layout, declared in ``config.json``).

``config.json`` gets

    "quantization_config": {"quant_method": "whisper-modifiers-sparse24",
                            "format": "sparse-24-bitmask", "sparsity_structure": "2:4",
                            "targets": [names of the compressed Linear modules]},
    "transformers_weights": format.STOCK_LOADER_GUARD

and, for a chain quantized to one int8/float8 value per weight (W8A8, FP8_DYNAMIC), the
original compressed-tensors ``quantization_config`` nested in it: the compressed values
are then the quantized ones, the scales are stored as before.

transformers and vLLM know this method only through this package (``checkpoint.
load_checkpoint`` and the vLLM plugin). Stock vLLM refuses it as an unknown method, naming
it; stock transformers refuses the ``transformers_weights`` guard with its text, which
names the package (without it transformers would skip the unknown method and load the 2:4
layers as random weights).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from whisper_modifiers.sparse_serving.format import (
    QUANT_METHOD,
    STOCK_LOADER_GUARD,
    CorruptCheckpointError,
    check_compressed,
    compress_24,
    decompress_24,
)

__all__ = [
    "QUANTIZED_FORMATS",
    "add_loader_guard",
    "dequantize",
    "is_sparse24_checkpoint",
    "verify_compressed_layers",
    "weight_files",
    "write_dense_layout",
    "write_sparse24",
]

_PARTS = ("compressed", "bitmask", "shape")
_REWRITTEN = ("config.json", "model.safetensors.index.json")
# compressed-tensors formats storing one quantized value per weight (W8A8, FP8_DYNAMIC)
QUANTIZED_FORMATS = ("int-quantized", "float-quantized")


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [directory / "model.safetensors"]


def verify_compressed_layers(files, expected_shapes: dict | None = None) -> list[str]:
    """Check every compressed 2:4 layer stored in the safetensors ``files`` before any
    weight is loaded (``format.check_compressed``: shapes, exactly two marks per group of
    four, clear padding), and its ``.shape`` against ``expected_shapes`` (layer name ->
    ``(out, in)``, from the model's config) where given. Reads the bitmasks and the
    ``.shape`` tensors, and only the headers of ``.compressed``. Raises
    ``CorruptCheckpointError`` naming the layer and the tensor; returns the layers' names."""
    with contextlib.ExitStack() as stack:
        where = {}
        for path in map(Path, files):
            try:
                handle = stack.enter_context(safe_open(path, "pt"))
            except Exception as error:  # safetensors' own error names no file
                raise CorruptCheckpointError(f"{path} cannot be read: {error}") from error
            where.update(dict.fromkeys(handle.keys(), handle))
        layers = sorted(key[: -len(".bitmask")] for key in where if key.endswith(".bitmask"))
        for name in layers:
            missing = [f"{name}.{part}" for part in ("compressed", "shape")
                       if f"{name}.{part}" not in where]  # fmt: skip
            if missing:
                raise CorruptCheckpointError(f"{name}: {', '.join(missing)} missing")
            shape = where[f"{name}.shape"].get_tensor(f"{name}.shape").reshape(-1).tolist()
            expected = (expected_shapes or {}).get(name)
            if len(shape) != 2 or (expected is not None and tuple(shape) != tuple(expected)):
                raise CorruptCheckpointError(
                    f"{name}.shape holds {shape}, but the model's config makes the layer "
                    f"{list(expected) if expected is not None else '[out, in]'}"
                )
            key = f"{name}.compressed"
            compressed = torch.empty(where[key].get_slice(key).get_shape(), device="meta")
            bitmask = where[f"{name}.bitmask"].get_tensor(f"{name}.bitmask")
            check_compressed(compressed, bitmask, shape, name)
    return layers


def add_loader_guard(directory: str | Path) -> None:
    """Write ``transformers_weights: STOCK_LOADER_GUARD`` into ``directory``'s
    ``config.json`` (the guard of the module docstring)."""
    config_path = Path(directory) / "config.json"
    config = json.loads(config_path.read_text())
    config["transformers_weights"] = STOCK_LOADER_GUARD
    config_path.write_text(json.dumps(config, indent=2))


def write_sparse24(directory: str | Path, targets: list[str]) -> dict:
    """Rewrite the saved checkpoint in ``directory``: the ``NAME.weight`` of every
    ``NAME`` in ``targets`` becomes ``NAME.compressed``/``.bitmask``/``.shape`` (a layer
    that is not exactly 2:4 raises ``NotTwoFourError`` naming it, before anything is
    written). Returns ``{"dense_bytes", "compressed_bytes"}`` of those weights."""
    directory = Path(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    quantization = config.get("quantization_config")
    if quantization and quantization.get("format") not in QUANTIZED_FORMATS:
        raise ValueError(
            f"{directory} is quantized in compressed-tensors' {quantization.get('format')!r} "
            f"format; the compressed 2:4 format holds unquantized weights or the "
            f"{' / '.join(QUANTIZED_FORMATS)} ones (one value per weight)"
        )
    wanted = {f"{name}.weight": name for name in targets}
    files, found, sizes = _compress_files(directory, wanted)
    missing = sorted(set(wanted) - found)
    if missing:
        raise ValueError(f"{directory} has no tensor {missing[0]} (of {len(missing)} targets)")
    index = directory / "model.safetensors.index.json"
    for path, (tensors, metadata) in files.items():
        save_file(tensors, path, metadata=metadata or {"format": "pt"})
    if index.is_file():
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        for key, name in wanted.items():
            shard = weight_map.pop(key)
            weight_map.update({f"{name}.{part}": shard for part in _PARTS})
        index.write_text(json.dumps(data, indent=2))
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format": "sparse-24-bitmask",
        "sparsity_structure": "2:4",
        "targets": sorted(targets),
    }
    if quantization:  # the compressed values are the quantized ones; scales as before
        config["quantization_config"]["quantization_config"] = quantization
    config["transformers_weights"] = STOCK_LOADER_GUARD
    config_path.write_text(json.dumps(config, indent=2))
    return sizes


def _compress_files(directory: Path, wanted: dict[str, str]):
    """Every weight file of ``directory`` in memory with the ``wanted`` weights
    (``NAME.weight`` -> ``NAME``) compressed, before anything is written: ``({path:
    (tensors, metadata)}, the wanted keys found, their dense and compressed bytes)``."""
    files, found, sizes = {}, set(), {"dense_bytes": 0, "compressed_bytes": 0}
    for path in weight_files(directory):  # compress everything first, then write
        tensors, metadata = {}, None
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata()
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                base = key[: -len(".weight_scale")]
                if key.endswith(".weight_scale") and f"{base}.weight" not in wanted:
                    raise ValueError(
                        f"{base} is quantized but not a 2:4 target: every quantized layer of "
                        "a compressed 2:4 checkpoint must be compressed"
                    )
                if key not in wanted:
                    tensors[key] = tensor
                    continue
                name = wanted[key]
                compressed, bitmask = compress_24(tensor, name)
                tensors[f"{name}.compressed"] = compressed
                tensors[f"{name}.bitmask"] = bitmask
                tensors[f"{name}.shape"] = torch.tensor(list(tensor.shape)).reshape(-1, 1)
                sizes["dense_bytes"] += tensor.numel() * tensor.element_size()
                sizes["compressed_bytes"] += sum(
                    t.numel() * t.element_size()
                    for t in (compressed, bitmask, tensors[f"{name}.shape"])
                )
                found.add(key)
        files[path] = (tensors, metadata)
    return files, found, sizes


def is_sparse24_checkpoint(config: dict) -> bool:
    """Whether ``config`` (a ``config.json``) declares compressed 2:4 weights that this
    package reads: its own format, or compressed-tensors' legacy ``sparse-24-bitmask``
    without quantization (the same tensors)."""
    quantization = config.get("quantization_config") or {}
    sparsity = quantization.get("sparsity_config") or {}
    return quantization.get("quant_method") == QUANT_METHOD or (
        quantization.get("quant_method") == "compressed-tensors"
        and sparsity.get("format") == "sparse-24-bitmask"
        and not quantization.get("config_groups")
    )


def write_dense_layout(source: str | Path, target: str | Path) -> Path:
    """A copy of the compressed checkpoint ``source`` in the dense layout, in ``target``:
    2:4 weights decompressed to ``NAME.weight`` (quantized values stay quantized, scales
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
            tensors[f"{name}.weight"] = decompress_24(
                tensors.pop(key), tensors.pop(f"{name}.bitmask"), shape, name
            )
        save_file(tensors, target / path.name, metadata=metadata or {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    index = source / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = weight_map
        (target / index.name).write_text(json.dumps(data, indent=2))
    config = json.loads((source / "config.json").read_text())
    if config.get("transformers_weights") == STOCK_LOADER_GUARD:
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
