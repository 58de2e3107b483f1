"""How ``config.json`` declares a compressed sparse checkpoint, and which stored layout each
compressed Linear has.

Our checkpoints declare

    "quantization_config": {"quant_method": "whisper-modifiers-sparse",
                            "format": "sparse-24-bitmask" | "sparse-bitmask" | "mixed",
                            "sparsity_structure": "2:4" | "unstructured" | "mixed",
                            "targets": [the 2:4 Linears (``two_four``'s layout)],
                            "bitmask_targets": [the others (``bitmask``'s layout)]},
    "transformers_weights": STOCK_LOADER_GUARD

and, for a chain quantized to one int8/float8 value per weight (W8A8, FP8_DYNAMIC), the
original compressed-tensors ``quantization_config`` nested in it. Checkpoints written
before unstructured layers (``quant_method: whisper-modifiers-sparse24``, no
``bitmask_targets``) read the same way, and so do the unquantized legacy
``sparse-24-bitmask`` and ``sparse-bitmask`` checkpoints of compressed-tensors < 0.15,
whose tensors are these layouts'.

transformers and vLLM know the method only through this package. Stock vLLM refuses it as
an unknown method, naming it; stock transformers refuses the ``transformers_weights`` guard
with its text, which names the package (without it transformers would skip the unknown
method and load the compressed layers as random weights).
"""

from __future__ import annotations

__all__ = [
    "BITMASK_FORMAT",
    "LEGACY_QUANT_METHOD",
    "QUANT_METHOD",
    "QUANT_METHODS",
    "STOCK_LOADER_GUARD",
    "STOCK_LOADER_GUARDS",
    "TWO_FOUR_FORMAT",
    "declaration",
    "is_compressed_checkpoint",
    "is_ours",
    "targets_by_format",
]

# config.json's quantization_config.quant_method: a name of our own (transformers cannot
# re-register "compressed-tensors"), and the name of the package whose plugin serves it,
# so that stock vLLM's "Unknown quantization method" names it
QUANT_METHOD = "whisper-modifiers-sparse"
LEGACY_QUANT_METHOD = "whisper-modifiers-sparse24"  # what 2:4-only checkpoints said first
QUANT_METHODS = (QUANT_METHOD, LEGACY_QUANT_METHOD)
TWO_FOUR_FORMAT = "sparse-24-bitmask"
BITMASK_FORMAT = "sparse-bitmask"

# config.json's ``transformers_weights``: the name of the weights file transformers should
# read, which vLLM ignores and stock transformers refuses (with this text in its
# ValueError) before any weight loads. The quantizer ``import whisper_sparse`` registers
# removes it.
STOCK_LOADER_GUARD = (
    "this is a compressed sparse checkpoint of whisper-modifiers; to load it, install its "
    "serving plugin whisper-sparse (pip install ./serving-plugin, from a clone of "
    "whisper-modifiers) and `import whisper_sparse` before from_pretrained "
    "(stock transformers would load its compressed layers as random weights)"
)
STOCK_LOADER_GUARDS = (
    STOCK_LOADER_GUARD,
    (  # and the texts checkpoints written before the plugin stood apart hold
        "this is a compressed sparse checkpoint of whisper-modifiers; to load it, run "
        "`pip install whisper-modifiers` and `import whisper_modifiers` before from_pretrained "
        "(stock transformers would load its compressed layers as random weights)"
    ),
    (
        "this is a compressed 2:4 checkpoint of whisper-modifiers; to load it, run "
        "`pip install whisper-modifiers` and `import whisper_modifiers` before from_pretrained "
        "(stock transformers would load its 2:4 layers as random weights)"
    ),
)


def declaration(
    two_four: list[str],
    bitmask: list[str],
    quantization: dict | None = None,
) -> dict:
    """``config.json``'s ``quantization_config`` for a checkpoint whose ``two_four`` and
    ``bitmask`` Linears are stored compressed (``quantization``: a W8A8 / FP8 chain's)."""
    formats = [
        name for name, layers in ((TWO_FOUR_FORMAT, two_four), (BITMASK_FORMAT, bitmask)) if layers
    ]
    structure = {TWO_FOUR_FORMAT: "2:4", BITMASK_FORMAT: "unstructured"}
    declared = {
        "quant_method": QUANT_METHOD,
        "format": formats[0] if len(formats) == 1 else "mixed",
        "sparsity_structure": structure[formats[0]] if len(formats) == 1 else "mixed",
        "targets": sorted(two_four),
        "bitmask_targets": sorted(bitmask),
    }
    if quantization:  # the compressed values are the quantized ones; scales as before
        declared["quantization_config"] = quantization
    return declared


def is_ours(quantization: dict | None) -> bool:
    """Whether a ``quantization_config`` is this package's (either name)."""
    return (quantization or {}).get("quant_method") in QUANT_METHODS


def _legacy_format(quantization: dict) -> str | None:
    """The layout of an unquantized legacy compressed-tensors sparse checkpoint we read."""
    sparsity = quantization.get("sparsity_config") or {}
    if (
        quantization.get("quant_method") == "compressed-tensors"
        and sparsity.get("format") in (TWO_FOUR_FORMAT, BITMASK_FORMAT)
        and not quantization.get("config_groups")
    ):
        return sparsity["format"]
    return None


def is_compressed_checkpoint(config: dict) -> bool:
    """Whether ``config`` (a ``config.json``) declares compressed sparse weights that this
    package reads: its own declaration, or an unquantized legacy compressed-tensors one."""
    quantization = config.get("quantization_config") or {}
    return is_ours(quantization) or _legacy_format(quantization) is not None


def targets_by_format(quantization: dict) -> tuple[dict[str, list[str]], list[str]]:
    """``({format: target names or patterns}, ignore)`` of a ``quantization_config`` that
    ``is_compressed_checkpoint`` accepts."""
    legacy = _legacy_format(quantization)
    if legacy is not None:
        sparsity = quantization["sparsity_config"]
        return {legacy: list(sparsity.get("targets") or [])}, list(sparsity.get("ignore") or [])
    return (
        {
            TWO_FOUR_FORMAT: list(quantization.get("targets") or []),
            BITMASK_FORMAT: list(quantization.get("bitmask_targets") or []),
        },
        list(quantization.get("ignore") or []),
    )
