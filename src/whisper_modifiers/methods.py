"""Pruning methods by name, as the benchmarks and examples use them.

``build_recipe("whisper", 0.5, "2:4", seed=1)`` returns the modifier list for
``oneshot(recipe=...)``.  Stock llmcompressor baselines get ``ignore: ["re:.*lm_head"]``
(its modules are named ``lm_head.``), ours ``["lm_head"]``: the LM head stays dense.
"""

from __future__ import annotations

from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier

from whisper_modifiers.modifiers import PIPELINE_NAME, REGISTRY, distributed
from whisper_modifiers.modifiers.baselines import sequence_sum_baseline
from whisper_modifiers.modifiers.layerwise_pipeline import check_attention_variable

__all__ = [
    "BASELINE_OF",
    "COMPOSITE_METHODS",
    "MAIN_METHODS",
    "METHODS",
    "PIPELINE_CHOICES",
    "build_recipe",
    "calibration_pipeline",
    "calibration_settings",
    "run_oneshot",
]

MAIN_METHODS = ("magnitude", "wanda", "wisp", "wisp_plus", "sparsegpt", "whisper")
COMPOSITE_METHODS = ("ria", "ria_wisp", "ria_wisp_plus", "alps", "alps_whisper")
_STOCK_METHODS = {"wanda": WandaPruningModifier, "sparsegpt": SparseGPTModifier}
METHODS = {
    name: _STOCK_METHODS.get(name) or REGISTRY[name] for name in MAIN_METHODS + COMPOSITE_METHODS
}
PIPELINE_CHOICES = ("auto", PIPELINE_NAME, "sequential")  # calibration_pipeline's
BASELINE_OF = {
    "wisp": "wanda",
    "wisp_plus": "wanda",
    "whisper": "sparsegpt",
    "ria_wisp": "ria",
    "ria_wisp_plus": "ria",
    "alps_whisper": "alps",
}


def build_recipe(
    method: str, sparsity: float, mask_structure: str = "0:0", seed: int = 0, **options
) -> list:
    """The one-modifier recipe of ``method``; ``options`` are extra modifier fields."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    cls = METHODS[method]
    fields = {"sparsity": sparsity, "mask_structure": mask_structure, **options}
    if cls in _STOCK_METHODS.values():
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
    (``distributed.shard_bounds``), the statistics are summed across ranks and each module
    is solved on one rank. llmcompressor's own Wanda and SparseGPT modifiers in a modifier
    list are swapped for ``baselines.sequence_sum_baseline``'s (the same solvers over
    statistics that do not depend on batch size or ranks), so that a baseline and our
    method at its baseline's gamma are the same arithmetic."""
    from llmcompressor import oneshot
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    num_ranks = distributed.world_size()
    if len(dataset) < num_ranks:
        raise ValueError(
            f"{len(dataset)} calibration sequences cannot be split over {num_ranks} ranks: "
            "each rank needs at least one (use more sequences or fewer processes)"
        )
    for modifier in recipe if isinstance(recipe, list) else []:
        if hasattr(modifier, "check_calibration_size"):
            modifier.check_calibration_size(len(dataset))
    start, end = distributed.shard_bounds(len(dataset), num_ranks)[distributed.rank()]
    shard = dataset.select(range(start, end)).with_format("torch")
    loader = DataLoader(
        shard, batch_size=batch_size, shuffle=False, collate_fn=default_data_collator
    )
    if isinstance(recipe, list):
        recipe = [sequence_sum_baseline(modifier) for modifier in recipe]
    with distributed.calibration_shard(start):
        return oneshot(model=model, tokenizer=tokenizer, dataset=loader, recipe=recipe, **kwargs)


def calibration_settings(
    model, num_sequences: int, seq_len: int, offload_device="auto", batch_size="auto"
) -> tuple[str, int]:
    """The activation-cache device and calibration batch size. ``auto`` keeps the cache on
    the GPU when it takes at most 40 % of the free GPU memory, else on the CPU; ``auto``
    batches one sequence per forward. A larger batch changes the floating-point order of
    the forward itself: on SmolLM2-135M (bfloat16) batch 4 changed 0.8 % of Wanda's 2:4
    mask and 5 % of SparseGPT's (``benchmarks/results/speed_batch.md``), for 10-19 %
    speed on a GPU, so a machine's free memory never changes the masks."""
    import torch

    config = model.config
    if offload_device == "auto":
        free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        itemsize = next(model.parameters()).element_size()
        cache = 2 * num_sequences * seq_len * config.hidden_size * itemsize
        offload_device = "cuda" if free and cache <= 0.4 * free else "cpu"
    return offload_device, 1 if batch_size == "auto" else int(batch_size)


def calibration_pipeline(choice: str = "auto") -> str:
    """``"whisper_layerwise"`` (``layerwise_pipeline``) or ``"sequential"`` (oneshot's
    default, each modifier through llmcompressor's sequential pipeline). ``auto``: ours on
    a GPU, where it was the faster of the two and held about half the GPU memory, and more
    so where the cache goes to the CPU (docs/gpu.md); ``sequential`` on a CPU. Checks
    ``$WHISPER_LAYERWISE_ATTENTION`` when ours is chosen."""
    import torch

    if choice not in PIPELINE_CHOICES:
        raise ValueError(f"pipeline must be one of {', '.join(PIPELINE_CHOICES)}; got {choice!r}")
    if choice == "auto":
        choice = PIPELINE_NAME if torch.cuda.is_available() else "sequential"
    if choice == PIPELINE_NAME:
        check_attention_variable()
    return choice
