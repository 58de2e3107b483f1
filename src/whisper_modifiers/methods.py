"""Pruning methods by name, as the benchmarks and examples use them.

``build_recipe("whisper", 0.5, "2:4", seed=1)`` returns the modifier list for
``oneshot(recipe=...)``.  Stock llmcompressor baselines get ``ignore: ["re:.*lm_head"]``
(its modules are named ``lm_head.``), ours ``["lm_head"]``: the LM head stays dense.
"""

from __future__ import annotations

from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier

from whisper_modifiers.modifiers import (
    ALPSModifier,
    ALPSWhisperModifier,
    OneShotMagnitudeModifier,
    RIAModifier,
    RIAWispModifier,
    RIAWispPlusModifier,
    WhisperModifier,
    WispModifier,
    WispPlusModifier,
)

__all__ = [
    "BASELINE_OF",
    "COMPOSITE_METHODS",
    "MAIN_METHODS",
    "METHODS",
    "build_recipe",
    "run_oneshot",
]

METHODS = {
    "magnitude": OneShotMagnitudeModifier,
    "wanda": WandaPruningModifier,
    "wisp": WispModifier,
    "wisp_plus": WispPlusModifier,
    "sparsegpt": SparseGPTModifier,
    "whisper": WhisperModifier,
    "ria": RIAModifier,
    "ria_wisp": RIAWispModifier,
    "ria_wisp_plus": RIAWispPlusModifier,
    "alps": ALPSModifier,
    "alps_whisper": ALPSWhisperModifier,
}
MAIN_METHODS = ("magnitude", "wanda", "wisp", "wisp_plus", "sparsegpt", "whisper")
COMPOSITE_METHODS = ("ria", "ria_wisp", "ria_wisp_plus", "alps", "alps_whisper")
BASELINE_OF = {
    "wisp": "wanda",
    "wisp_plus": "wanda",
    "whisper": "sparsegpt",
    "ria_wisp": "ria",
    "ria_wisp_plus": "ria",
    "alps_whisper": "alps",
}
_STOCK = (WandaPruningModifier, SparseGPTModifier)


def build_recipe(
    method: str, sparsity: float, mask_structure: str = "0:0", seed: int = 0, **options
) -> list:
    """The one-modifier recipe of ``method``; ``options`` are extra modifier fields."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    cls = METHODS[method]
    fields = {"sparsity": sparsity, "mask_structure": mask_structure, **options}
    if cls in _STOCK:
        fields.setdefault("ignore", ["re:.*lm_head"])
    if "seed" in cls.model_fields:
        fields.setdefault("seed", seed)
    return [cls(**fields)]


def run_oneshot(model, tokenizer, dataset, recipe, **kwargs):
    """llmcompressor's ``oneshot`` on every row of ``dataset`` in its given order
    (``shuffle_calibration_samples=False``: the seeded pairs, and so the masks, are
    reproducible), one sequence per batch row; ``kwargs`` go to ``oneshot``."""
    from llmcompressor import oneshot

    return oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(dataset),
        max_seq_length=max(len(row) for row in dataset["input_ids"]),
        shuffle_calibration_samples=False,
        **kwargs,
    )
