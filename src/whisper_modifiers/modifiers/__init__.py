from whisper_modifiers.modifiers.base import (
    DEFAULT_DIFFERENCE_TARGETS,
    DifferencePruningBase,
)
from whisper_modifiers.modifiers.magnitude import OneShotMagnitudeModifier
from whisper_modifiers.modifiers.whisper import WhisperModifier
from whisper_modifiers.modifiers.wisp import WispModifier, WispPlusModifier

__all__ = [
    "DEFAULT_DIFFERENCE_TARGETS",
    "DifferencePruningBase",
    "OneShotMagnitudeModifier",
    "WhisperModifier",
    "WispModifier",
    "WispPlusModifier",
]
