"""The record of what pruning did, and loading a checkpoint in transformers.

llmcompressor 0.14 saves pruned weights dense (zeros stored) in the compressed-tensors
layout that transformers and current vLLM load.  ``sparsity_record`` describes each
Linear (sparsity and pattern) with the method and recipe, taken from the model in memory
before it is saved (a packed W4A16 module has no ``weight`` after saving), and
``write_record`` stores it as ``sparsity_record.json`` beside the weights: a file vLLM
ignores, unlike a ``sparsity_config`` with targets in ``config.json``, which current vLLM
refuses. ``load_checkpoint`` loads a checkpoint in transformers with its weights
dequantized, after ``whisper_sparse.format.checkpoint.check_checkpoint``.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch

from whisper_sparse.format.checkpoint import RECORD_FILE, check_checkpoint
from whisper_sparse.format.declaration import is_compressed_checkpoint, is_ours

__all__ = [
    "layer_sparsity",
    "load_checkpoint",
    "overall_sparsity",
    "sparsity_record",
    "strict_json",
    "write_record",
]


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


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32):
    """``check_checkpoint``, then load it with transformers, quantized weights dequantized
    to ``dtype`` (``run_compressed=False``: a packed W4A16 module otherwise stays packed and
    has no ``weight``) and compressed sparse weights decompressed (``loading_dense``: every
    Linear an ``nn.Linear`` with its weight, also where a plain ``from_pretrained`` keeps
    them compressed for the CPU op).

    A compressed checkpoint of ours without quantization loads through the quantizer
    ``import whisper_modifiers`` registered with transformers. A quantized one (W8A8, FP8)
    or a legacy compressed-tensors one is first rewritten in the dense layout in a
    temporary directory (``whisper_sparse.format.layout.write_dense_layout``) and loaded from
    there, so a quantized chain runs compressed-tensors' quantized forward (activation
    quantization included) exactly as its dense layout would.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from whisper_sparse.format.layout import write_dense_layout
    from whisper_sparse.transformers_adapter.quantizer import loading_dense

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
