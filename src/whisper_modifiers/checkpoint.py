"""Checkpoint checks and the record of what pruning did.

llmcompressor 0.14 saves pruned weights dense (zeros stored) in the compressed-tensors
layout that transformers and current vLLM load.  ``sparsity_record`` describes each
Linear (sparsity and pattern) with the method and recipe, taken from the model in memory
before it is saved (a packed W4A16 module has no ``weight`` after saving), and
``write_record`` stores it as ``sparsity_record.json`` beside the weights: a file vLLM
ignores, unlike a ``sparsity_config`` with targets in ``config.json``, which current vLLM
refuses. ``check_checkpoint`` fails clearly on a directory that is not a loadable
checkpoint; ``load_checkpoint`` loads one in transformers with its weights dequantized.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch

from whisper_modifiers.sparse_serving.format.declaration import (
    is_compressed_checkpoint,
    is_ours,
    targets_by_format,
)
from whisper_modifiers.sparse_serving.format.layout import verify_compressed_layers, weight_files

__all__ = [
    "RECORD_FILE",
    "REPORT_FILE",
    "TOKENIZER_FILES",
    "check_checkpoint",
    "is_unfinished_output",
    "layer_sparsity",
    "load_checkpoint",
    "read_config",
    "overall_sparsity",
    "sparsity_record",
    "strict_json",
    "write_record",
]

RECORD_FILE = "sparsity_record.json"
REPORT_FILE = "whisper_prune_report.json"  # marks a checkpoint whisper-prune wrote
# while whisper-prune writes NAME, it writes .NAME.partial-XXXX holding a locked LOCK_FILE
PARTIAL_MARK = ".partial-"
LOCK_FILE = ".whisper-prune.lock"
# a checkpoint vLLM serves needs its tokenizer: one of these (fast, SentencePiece, BPE,
# WordPiece vocabularies) beside the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
LEGACY_SPARSE_FORMATS = ("sparse-24-bitmask", "sparse-bitmask", "marlin-24")


def _pattern(weight: torch.Tensor) -> str:
    zeros = weight == 0
    if not zeros.any():
        return "dense"
    if weight.shape[1] % 4 == 0 and (zeros.reshape(weight.shape[0], -1, 4).sum(-1) >= 2).all():
        return "2:4"
    return "unstructured"


def layer_sparsity(model: torch.nn.Module) -> dict[str, dict]:
    """Per Linear module: its sparsity and pattern (``"2:4"`` when every group of four
    consecutive inputs has at least two zeros, else ``"unstructured"`` or ``"dense"``)."""
    record = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.detach()
            record[name] = {
                "shape": list(weight.shape),
                "sparsity": round(float((weight == 0).float().mean()), 6),
                "pattern": _pattern(weight),
            }
    return record


def overall_sparsity(model: torch.nn.Module) -> float:
    """Fraction of zeros over every Linear weight but the LM head."""
    zeros = total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            zeros += int((module.weight == 0).sum())
            total += module.weight.numel()
    return zeros / max(total, 1)


def sparsity_record(model: torch.nn.Module, **details) -> dict:
    """What pruning did to ``model`` (call it before saving): ``details`` (method, recipe,
    source model), a summary (overall sparsity, pruned and dense layer counts, patterns)
    and ``layer_sparsity``."""
    layers = layer_sparsity(model)
    pruned = [v for v in layers.values() if v["pattern"] != "dense"]
    summary = {
        "sparsity": round(overall_sparsity(model), 6),
        "pruned_layers": len(pruned),
        "dense_layers": len(layers) - len(pruned),
        "patterns": sorted({v["pattern"] for v in pruned}),
    }
    return {**details, "summary": summary, "layers": layers}


def write_record(directory: str | Path, record: dict) -> Path:
    """Write ``record`` (from ``sparsity_record``) as ``sparsity_record.json``."""
    path = Path(directory) / RECORD_FILE
    path.write_text(strict_json(record))
    return path


def strict_json(value) -> str:
    """``value`` as strict JSON (RFC 8259, which has no ``Infinity`` or ``NaN``): a
    non-finite number, such as the standard error of a difference over one held-out
    sequence, is written as ``null``."""

    def finite(item):
        if isinstance(item, float) and not math.isfinite(item):
            return None
        if isinstance(item, dict):
            return {key: finite(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [finite(v) for v in item]
        return item

    return json.dumps(finite(value), indent=2, allow_nan=False)


def read_config(directory: str | Path) -> dict:
    """``directory/config.json`` as a dict; a missing or unparsable file is an error that
    names it."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint: config.json is missing")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds a JSON {type(config).__name__}, not an object")
    return config


def check_checkpoint(directory: str | Path, unfinished_ok: bool = False) -> dict:
    """Raise a clear error if ``directory`` is not a complete, loadable checkpoint in a
    layout current transformers/vLLM read; returns its ``config.json``.

    Complete means: ``config.json`` parses, every weight file is present, a tokenizer is
    saved beside them (``TOKENIZER_FILES``), and a checkpoint that ``whisper-prune``
    wrote (``REPORT_FILE``) has its ``sparsity_record.json``.  An unfinished
    ``whisper-prune`` output (a ``.NAME.partial-*`` directory left by a killed run) is
    refused unless ``unfinished_ok`` (whisper-prune's own check before renaming it).

    Compressed sparse checkpoints (``sparse_serving.format``: this package's 2:4 and
    unstructured layouts, and the unquantized legacy ``sparse-24-bitmask`` and
    ``sparse-bitmask`` of compressed-tensors < 0.15, which have the same tensors) are
    accepted, every stored layer checked: ``load_checkpoint`` and the vLLM plugin read
    them. Other legacy sparse formats are refused with the way to convert them: current
    compressed-tensors has no decompressor for them, and vLLM no kernel.
    """
    directory = Path(directory)
    if not unfinished_ok and is_unfinished_output(directory):
        raise ValueError(
            f"{directory} is an unfinished whisper-prune output (the run writing it was "
            "stopped, or is still running); it is not a checkpoint"
        )
    config = read_config(directory)
    _check_not_legacy(directory, config)
    _check_files_present(directory)
    if is_compressed_checkpoint(config):  # every stored layer, before anything loads it
        verify_compressed_layers(weight_files(directory), declared=_declared(config))
    return config


def _declared(config: dict) -> dict[str, str] | None:
    """Our checkpoint's compressed layers by name -> layout (a legacy one names patterns)."""
    quantization = config.get("quantization_config") or {}
    if not is_ours(quantization):
        return None
    by_format, _ = targets_by_format(quantization)
    return {name: format for format, names in by_format.items() for name in names}


def _check_not_legacy(directory: Path, config: dict) -> None:
    """Refuse a legacy sparse format this package cannot read, with the way to convert."""
    sparsity = (config.get("quantization_config") or {}).get("sparsity_config") or {}
    if sparsity.get("format") in LEGACY_SPARSE_FORMATS and not is_compressed_checkpoint(config):
        raise ValueError(
            f"{directory} stores weights in the legacy {sparsity['format']!r} format of "
            "compressed-tensors < 0.15 (quantized, or marlin-24), which current "
            "compressed-tensors cannot decompress and current vLLM cannot serve (this package "
            "reads the unquantized 'sparse-24-bitmask' and 'sparse-bitmask' only). Convert it "
            "to the dense layout "
            "in an environment "
            "with the old library: pip install 'compressed-tensors<0.15' 'llmcompressor<0.8'; "
            "then load it with transformers (which decompresses it) and save_pretrained() it "
            "again, or re-run the recipe on the original model with this package."
        )


def _check_files_present(directory: Path) -> None:
    """Every weight shard, a tokenizer, and whisper-prune's record beside its report."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(s for s in shards if not (directory / s).is_file())
        if missing:
            raise FileNotFoundError(
                f"{directory} is incomplete: its index lists shards that are missing: "
                f"{', '.join(missing)}"
            )
    elif not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{directory} is incomplete: no model.safetensors (nor a sharded index)"
        )
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{directory} is incomplete: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "save it beside the weights (tokenizer.save_pretrained)"
        )
    if (directory / REPORT_FILE).is_file() and not (directory / RECORD_FILE).is_file():
        raise FileNotFoundError(
            f"{directory} is incomplete: whisper-prune wrote it ({REPORT_FILE}) but its "
            f"{RECORD_FILE} is missing"
        )


def is_unfinished_output(directory: str | Path) -> bool:
    """Whether ``directory`` is an unfinished ``whisper-prune`` output: a hidden
    ``.NAME.partial-*`` directory, or one that still holds the writer's lock file."""
    directory = Path(directory)
    return (directory.name.startswith(".") and PARTIAL_MARK in directory.name) or (
        directory / LOCK_FILE
    ).exists()


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32):
    """``check_checkpoint``, then load it with transformers, quantized weights dequantized
    to ``dtype`` (``run_compressed=False``: a packed W4A16 module otherwise stays packed and
    has no ``weight``) and compressed sparse weights decompressed (``loading_dense``: every
    Linear an ``nn.Linear`` with its weight, also where a plain ``from_pretrained`` keeps
    them compressed for the CPU op).

    A compressed checkpoint of ours without quantization loads through the quantizer
    ``import whisper_modifiers`` registered with transformers. A quantized one (W8A8, FP8)
    or a legacy compressed-tensors one is first rewritten in the dense layout in a
    temporary directory (``sparse_serving.format.layout.write_dense_layout``) and loaded from
    there, so a quantized chain runs compressed-tensors' quantized forward (activation
    quantization included) exactly as its dense layout would.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from whisper_modifiers.sparse_serving.format.layout import write_dense_layout
    from whisper_modifiers.sparse_serving.transformers_adapter.quantizer import loading_dense

    config = check_checkpoint(directory)
    quantization = config.get("quantization_config") or {}
    if is_compressed_checkpoint(config) and (
        not is_ours(quantization) or quantization.get("quantization_config")
    ):
        with tempfile.TemporaryDirectory() as tmp:
            return load_checkpoint(write_dense_layout(directory, Path(tmp) / "dense"), dtype)
    kwargs = {}
    if quantization.get("quant_method") == "compressed-tensors":
        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    with loading_dense():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
