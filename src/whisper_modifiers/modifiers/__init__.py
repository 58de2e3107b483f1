from whisper_modifiers.modifiers.base import DEFAULT_DIFFERENCE_TARGETS, DifferencePruningBase
from whisper_modifiers.modifiers.magnitude import OneShotMagnitudeModifier
from whisper_modifiers.modifiers.whisper import (
    ALPSModifier,
    ALPSWhisperModifier,
    WhisperModifier,
)
from whisper_modifiers.modifiers.wisp import (
    RIAModifier,
    RIAWispModifier,
    RIAWispPlusModifier,
    WispModifier,
    WispPlusModifier,
)

__all__ = [
    "DEFAULT_DIFFERENCE_TARGETS",
    "ALPSModifier",
    "ALPSWhisperModifier",
    "DifferencePruningBase",
    "OneShotMagnitudeModifier",
    "RIAModifier",
    "RIAWispModifier",
    "RIAWispPlusModifier",
    "WhisperModifier",
    "WispModifier",
    "WispPlusModifier",
]
