"""Difference-informed one-shot pruning (Wisp, Wisp+, Whisper) for llmcompressor.

Importing this package registers every modifier in ``MODIFIERS`` (``modifiers.REGISTRY``'s
and ``MaskedGPTQModifier``) with llmcompressor's ``ModifierFactory`` under its class name,
so YAML recipes can name them; has oneshot's save write the compressed checkpoint after a
recipe with one of our pruning modifiers (``saving.save_compressed_after``, from their
``on_finalize``); and registers the compressed checkpoint formats with transformers'
quantizer registry (through the serving plugin, ``whisper_sparse``, which the serving
environment installs alone).
"""

from llmcompressor.modifiers.factory import ModifierFactory

import whisper_sparse  # noqa: F401  (registers the compressed formats with transformers)
from whisper_modifiers import modifiers as _modifiers
from whisper_modifiers.modifiers import *  # noqa: F403  (the modifiers' own __all__)
from whisper_modifiers.saving import save_compressed_after as _save_compressed_after

for _modifier in _modifiers.MODIFIERS:
    ModifierFactory.register(_modifier.__name__, _modifier)

# oneshot's own save (and save_pretrained) writes the compressed checkpoint after a recipe
# with one of our pruning modifiers (saving.save_compressed_after: their on_finalize,
# through modifiers.finalize_hook)
_save_compressed_after()

__version__ = "0.1.0"
__all__ = list(_modifiers.__all__)
