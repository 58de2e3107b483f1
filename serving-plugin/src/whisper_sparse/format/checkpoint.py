"""Whether a directory is a complete checkpoint that current transformers and vLLM load:
``check_checkpoint`` fails clearly on one that is not (a missing file, a legacy sparse
format, a half-written ``whisper-prune`` output, a compressed layer that fails its check).

Imports only the standard library (and this subpackage).
"""

from __future__ import annotations

import json
from pathlib import Path

from whisper_sparse.format.declaration import is_compressed_checkpoint, is_ours, targets_by_format
from whisper_sparse.format.layout import verify_compressed_layers, weight_files

__all__ = [
    "LOCK_FILE",
    "PARTIAL_MARK",
    "RECORD_FILE",
    "REPORT_FILE",
    "TOKENIZER_FILES",
    "check_checkpoint",
    "is_unfinished_output",
    "read_config",
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
