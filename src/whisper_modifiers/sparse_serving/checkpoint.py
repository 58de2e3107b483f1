"""Compressed 2:4 checkpoints on disk (``format``'s layout, declared in ``config.json``).

``config.json`` gets

    "quantization_config": {"quant_method": "whisper-modifiers-sparse24",
                            "format": "sparse-24-bitmask", "sparsity_structure": "2:4",
                            "targets": [names of the compressed Linear modules]}

transformers and vLLM know this method only through this package (``checkpoint.
load_checkpoint`` and the vLLM plugin); stock vLLM refuses it as an unknown method,
naming it, rather than loading a wrong model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from whisper_modifiers.sparse_serving.format import QUANT_METHOD, compress_24, decompress_24

__all__ = ["is_sparse24_checkpoint", "read_dense_state_dict", "write_sparse24"]

_PARTS = ("compressed", "bitmask", "shape")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [directory / "model.safetensors"]


def write_sparse24(directory: str | Path, targets: list[str]) -> dict:
    """Rewrite the saved checkpoint in ``directory``: the ``NAME.weight`` of every
    ``NAME`` in ``targets`` becomes ``NAME.compressed``/``.bitmask``/``.shape`` (a layer
    that is not exactly 2:4 raises ``NotTwoFourError`` naming it, before anything is
    written). Returns ``{"dense_bytes", "compressed_bytes"}`` of those weights."""
    directory = Path(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("quantization_config"):
        raise ValueError(
            f"{directory} is already quantized ({config['quantization_config'].get('format')}); "
            "the compressed 2:4 format holds unquantized weights only"
        )
    wanted = {f"{name}.weight": name for name in targets}
    files, found, sizes = {}, set(), {"dense_bytes": 0, "compressed_bytes": 0}
    for path in _weight_files(directory):  # compress everything first, then write
        tensors, metadata = {}, None
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata()
            for key in handle.keys():
                tensor = handle.get_tensor(key)
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
    config_path.write_text(json.dumps(config, indent=2))
    return sizes


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


def read_dense_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, 2:4 layers decompressed to ``NAME.weight``."""
    state = {}
    for path in _weight_files(Path(directory)):
        with safe_open(path, "pt") as handle:
            state.update({key: handle.get_tensor(key) for key in handle.keys()})
    for key in [k for k in state if k.endswith(".compressed")]:
        name = key[: -len(".compressed")]
        shape = state.pop(f"{name}.shape").reshape(-1).tolist()
        state[f"{name}.weight"] = decompress_24(state.pop(key), state.pop(f"{name}.bitmask"), shape)
    return state
