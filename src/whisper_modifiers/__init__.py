"""Difference-informed one-shot pruning (Wisp, Wisp+, Whisper) for llmcompressor.

Importing this package registers every modifier in ``MODIFIERS`` with llmcompressor's
``ModifierFactory`` under its class name, so YAML recipes can name them. In the serving
environment, which has vLLM but not llmcompressor, nothing is imported: only the
``sparse_serving`` subpackage (the vLLM plugin) is used there.
"""

import importlib.util

__version__ = "0.1.0"
__all__ = []

if importlib.util.find_spec("llmcompressor") is not None:
    from llmcompressor.modifiers.factory import ModifierFactory

    from whisper_modifiers.modifiers import (
        DEFAULT_DIFFERENCE_TARGETS,
        ALPSModifier,
        ALPSWhisperModifier,
        DifferencePruningBase,
        MaskedGPTQModifier,
        OneShotMagnitudeModifier,
        RIAModifier,
        RIAWispModifier,
        RIAWispPlusModifier,
        WhisperModifier,
        WispModifier,
        WispPlusModifier,
    )

    MODIFIERS = (
        WispModifier,
        WispPlusModifier,
        WhisperModifier,
        OneShotMagnitudeModifier,
        RIAModifier,
        RIAWispModifier,
        RIAWispPlusModifier,
        ALPSModifier,
        ALPSWhisperModifier,
        MaskedGPTQModifier,
    )
    for _modifier in MODIFIERS:
        ModifierFactory.register(_modifier.__name__, _modifier)

    __all__ = [
        "DEFAULT_DIFFERENCE_TARGETS",
        "MODIFIERS",
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
    ]
