from whisper_modifiers.modifiers.base import DEFAULT_DIFFERENCE_TARGETS, DifferencePruningBase
from whisper_modifiers.modifiers.magnitude import OneShotMagnitudeModifier
from whisper_modifiers.modifiers.masked_gptq import MaskedGPTQModifier, check_mask_kept
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
    "MaskedGPTQModifier",
    "OneShotMagnitudeModifier",
    "RIAModifier",
    "RIAWispModifier",
    "RIAWispPlusModifier",
    "WhisperModifier",
    "WispModifier",
    "WispPlusModifier",
    "check_mask_kept",
]
