"""The seam between the pruning modifiers and what follows a finished recipe (saving).

llmcompressor calls each modifier's ``on_finalize`` when its lifecycle finalizes a recipe
(``Modifier.on_finalize``, the library's own seam). Our pruning modifiers end theirs with
``pruning_finalized(state, modifier)``, which runs every callback registered here with
``after_pruning_finalize``. The modifiers thus import nothing above them: the package's
entry registers ``saving``'s callback, which has ``oneshot``'s save write the compressed
checkpoint. Nothing of llmcompressor is patched.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["after_pruning_finalize", "pruning_finalized"]

_callbacks: list[Callable] = []


def after_pruning_finalize(callback: Callable) -> None:
    """Run ``callback(state, modifier)`` whenever one of this package's pruning modifiers
    finalizes (once per callback, however often it is registered)."""
    if callback not in _callbacks:
        _callbacks.append(callback)


def pruning_finalized(state, modifier) -> None:
    """Called by a pruning modifier at the end of its ``on_finalize``."""
    for callback in list(_callbacks):
        callback(state, modifier)
