"""Difference-informed one-shot pruning (Wisp, Wisp+, Whisper) for llmcompressor.

Importing this package registers ``WispModifier``, ``WispPlusModifier``,
``WhisperModifier`` and ``OneShotMagnitudeModifier`` with llmcompressor's
``ModifierFactory``, so YAML recipes can name them.
"""

from llmcompressor.modifiers.factory import ModifierFactory

from whisper_modifiers.modifiers import (
    DEFAULT_DIFFERENCE_TARGETS,
    DifferencePruningBase,
    OneShotMagnitudeModifier,
    WhisperModifier,
    WispModifier,
    WispPlusModifier,
)

MODIFIERS = (WispModifier, WispPlusModifier, WhisperModifier, OneShotMagnitudeModifier)
for _modifier in MODIFIERS:
    ModifierFactory.register(_modifier.__name__, _modifier)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_DIFFERENCE_TARGETS",
    "MODIFIERS",
    "DifferencePruningBase",
    "OneShotMagnitudeModifier",
    "WhisperModifier",
    "WispModifier",
    "WispPlusModifier",
]
