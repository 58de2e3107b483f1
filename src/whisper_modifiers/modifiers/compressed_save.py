"""The pruning modifiers' part in saving: when one finalizes, the model's
``save_pretrained`` is wrapped so that llmcompressor's own save (``oneshot(...,
output_dir=D)``, ``model.save_pretrained(D, save_compressed=True)``) writes the compressed
2:4 checkpoint that whisper-prune writes (``saving.install_compressed_save``)."""

from __future__ import annotations

from llmcompressor.core import State, active_session
from pydantic import BaseModel

from whisper_modifiers.saving import install_compressed_save

__all__ = ["CompressedSave"]


class CompressedSave(BaseModel):
    """Mixin for this package's pruning modifiers (see the module docstring)."""

    def on_finalize(self, state: State, **kwargs) -> bool:
        done = super().on_finalize(state, **kwargs)
        install_compressed_save(state.model, active_session().lifecycle.recipe.modifiers)
        return done
