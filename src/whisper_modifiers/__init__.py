"""Difference-informed one-shot pruning (Wisp, Wisp+, Whisper) for llmcompressor.

Importing this package registers every modifier in ``MODIFIERS`` (``modifiers.REGISTRY``'s
and ``MaskedGPTQModifier``) with llmcompressor's ``ModifierFactory`` under its class name,
so YAML recipes can name them; has oneshot's save write the compressed checkpoint after a
recipe with one of our pruning modifiers (``saving.save_compressed_after``, from their
``on_finalize``); and registers the compressed 2:4 checkpoint format
with transformers' quantizer registry. In the serving
environment, which has vLLM but not llmcompressor, nothing is imported: only the
``sparse_serving`` subpackage (the vLLM plugin) is used there.
"""

import importlib.util

__version__ = "0.1.0"
__all__ = []

if importlib.util.find_spec("llmcompressor") is not None:
    from llmcompressor.modifiers.factory import ModifierFactory

    from whisper_modifiers import modifiers as _modifiers
    from whisper_modifiers.modifiers import *  # noqa: F403  (the modifiers' own __all__)

    for _modifier in _modifiers.MODIFIERS:
        ModifierFactory.register(_modifier.__name__, _modifier)

    # oneshot's own save (and save_pretrained) writes the compressed checkpoint after a
    # recipe with one of our pruning modifiers (saving.save_compressed_after: their
    # on_finalize, through modifiers.finalize_hook)
    from whisper_modifiers.saving import save_compressed_after as _save_compressed_after

    _save_compressed_after()

    # transformers loads compressed 2:4 checkpoints (decompressed) from now on
    from whisper_modifiers.sparse_serving.transformers_adapter.quantizer import (
        register as _register_sparse24,
    )

    _register_sparse24()

    __all__ = list(_modifiers.__all__)
