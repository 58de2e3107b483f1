"""The serving kernel mode: whether sparse layers run compressed, set by
``$WHISPER_MODIFIERS_SPARSE`` (its name before unstructured layers,
``$WHISPER_MODIFIERS_SPARSE24``, still works).

Imports nothing of this package: the CPU engine, the GPU engine and both adapters read it.
"""

from __future__ import annotations

import os

__all__ = ["KERNEL_MODES", "KERNEL_MODE_VARIABLE", "LEGACY_KERNEL_MODE_VARIABLE", "kernel_mode"]

KERNEL_MODE_VARIABLE = "WHISPER_MODIFIERS_SPARSE"
LEGACY_KERNEL_MODE_VARIABLE = "WHISPER_MODIFIERS_SPARSE24"
KERNEL_MODES = ("auto", "sparse", "dense")


def _read(variable: str) -> str | None:
    value = os.environ.get(variable)
    return None if value is None or not value.strip() else value.strip().lower()


def kernel_mode() -> str:
    """``$WHISPER_MODIFIERS_SPARSE`` (or ``$WHISPER_MODIFIERS_SPARSE24``): ``auto``
    (default; on a GPU, cuSPARSELt where measured faster and the dense weight below; on a
    CPU, the CPU op on every layer whose measured plan beat dense at one token,
    ``cpu.linear``), ``sparse`` (the compressed weight alone, always run sparse) or
    ``dense`` (decompressed, no sparse kernel). Both variables set to different modes is
    an error naming both."""
    mode, legacy = _read(KERNEL_MODE_VARIABLE), _read(LEGACY_KERNEL_MODE_VARIABLE)
    if mode is not None and legacy is not None and mode != legacy:
        raise ValueError(
            f"{KERNEL_MODE_VARIABLE}={mode!r} and {LEGACY_KERNEL_MODE_VARIABLE}={legacy!r} "
            f"disagree; set one ({LEGACY_KERNEL_MODE_VARIABLE} is its old name)"
        )
    mode = mode or legacy or "auto"
    variable = KERNEL_MODE_VARIABLE if _read(KERNEL_MODE_VARIABLE) else LEGACY_KERNEL_MODE_VARIABLE
    if mode not in KERNEL_MODES:
        raise ValueError(f"{variable}={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    return mode
