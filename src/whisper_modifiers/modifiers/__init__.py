from whisper_modifiers.modifiers.base import DEFAULT_DIFFERENCE_TARGETS, DifferencePruningBase
from whisper_modifiers.modifiers.layerwise_pipeline import PIPELINE_NAME, LayerwisePipeline
from whisper_modifiers.modifiers.magnitude import OneShotMagnitudeModifier
from whisper_modifiers.modifiers.masked_gptq import MaskedGPTQModifier
from whisper_modifiers.modifiers.ria import RIAModifier, RIAWispModifier, RIAWispPlusModifier
from whisper_modifiers.modifiers.validation import check_mask_kept
from whisper_modifiers.modifiers.whisper import (
    ALPSModifier,
    ALPSWhisperModifier,
    WhisperModifier,
)
from whisper_modifiers.modifiers.wisp import WispModifier, WispPlusModifier

# The modifiers of this package, by method name: the one list. The package registers them
# (with MaskedGPTQModifier) with llmcompressor; methods.py adds llmcompressor's Wanda and
# SparseGPT to them; the diagnostics prune single layers by the same names.
REGISTRY = {
    "magnitude": OneShotMagnitudeModifier,
    "wisp": WispModifier,
    "wisp_plus": WispPlusModifier,
    "whisper": WhisperModifier,
    "ria": RIAModifier,
    "ria_wisp": RIAWispModifier,
    "ria_wisp_plus": RIAWispPlusModifier,
    "alps": ALPSModifier,
    "alps_whisper": ALPSWhisperModifier,
}
MODIFIERS = (*REGISTRY.values(), MaskedGPTQModifier)

__all__ = [
    "DEFAULT_DIFFERENCE_TARGETS",
    "MODIFIERS",
    "PIPELINE_NAME",
    "REGISTRY",
    "ALPSModifier",
    "ALPSWhisperModifier",
    "DifferencePruningBase",
    "LayerwisePipeline",
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
