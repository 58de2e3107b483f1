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
    distributed,
)

__all__ = [
    "BASELINE_OF",
    "COMPOSITE_METHODS",
    "MAIN_METHODS",
    "METHODS",
    "build_recipe",
    "calibration_settings",
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


def run_oneshot(model, tokenizer, dataset, recipe, batch_size: int = 1, **kwargs):
    """llmcompressor's ``oneshot`` on every row of ``dataset`` in its given order,
    ``batch_size`` sequences per forward; ``kwargs`` go to ``oneshot``
    (``sequential_offload_device``, …).

    The rows reach the pipeline through our own sequential ``DataLoader``: sequence
    ``i``'s pairs are seeded by ``i`` whatever the batch size (llmcompressor's sampler
    would sort equal-length rows with an unstable sort). Under torchrun
    (``distributed.init_from_torchrun``) each rank calibrates its contiguous shard
    (``distributed.shard_bounds``), the statistics are reduced across ranks and each module
    is solved on one rank; llmcompressor's own Wanda and SparseGPT modifiers in a modifier
    list are swapped for their distributed versions."""
    from llmcompressor import oneshot
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    num_ranks = distributed.world_size()
    if len(dataset) < num_ranks:
        raise ValueError(
            f"{len(dataset)} calibration sequences cannot be split over {num_ranks} ranks: "
            "each rank needs at least one (use more sequences or fewer processes)"
        )
    start, end = distributed.shard_bounds(len(dataset), num_ranks)[distributed.rank()]
    shard = dataset.select(range(start, end)).with_format("torch")
    loader = DataLoader(shard, batch_size=batch_size, shuffle=False,
                        collate_fn=default_data_collator)  # fmt: skip
    if num_ranks > 1 and isinstance(recipe, list):
        recipe = [distributed.distributed_baseline(modifier) for modifier in recipe]
    with distributed.calibration_shard(start):
        return oneshot(model=model, tokenizer=tokenizer, dataset=loader, recipe=recipe, **kwargs)


def calibration_settings(model, num_sequences: int, seq_len: int, offload_device="auto",
                         batch_size="auto") -> tuple[str, int]:  # fmt: skip
    """The activation-cache device and calibration batch size: ``auto`` keeps the cache on
    the GPU when it takes at most 40 % of the free GPU memory, and batches up to 4
    sequences while eager attention's scores and the MLP activations of a batch take at
    most 10 % of it; on CPU, the cache stays on the CPU with batches of 1."""
    import torch

    config = model.config
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    if offload_device == "auto":
        itemsize = next(model.parameters()).element_size()
        cache = 2 * num_sequences * seq_len * config.hidden_size * itemsize
        offload_device = "cuda" if free and cache <= 0.4 * free else "cpu"
    if batch_size == "auto":
        heads = getattr(config, "num_attention_heads", 1)
        width = getattr(config, "intermediate_size", 4 * config.hidden_size)
        per_sequence = 4 * (heads * seq_len * seq_len + 3 * seq_len * width)
        batch_size = 1
        while free and batch_size < 4 and 2 * batch_size * per_sequence <= 0.1 * free:
            batch_size *= 2
        batch_size = min(batch_size, num_sequences)
    return offload_device, int(batch_size)
