"""whisper-prune's recipes: found by file or name, parsed once, checked against the model
before any weight loads.

Every refusal is a ``preflight.UsageError`` naming ``--recipe``: a recipe that cannot be
read or parsed or defines no modifier, a ``difference_targets`` pattern that matches no
module, a stock GPTQ after pruning, quantization before pruning, a quantization modifier
left with no layer to quantize, ``gamma: auto`` without a held-out sequence, and a
``--layout`` the recipe cannot be stored in.
"""

from __future__ import annotations

from pathlib import Path

from whisper_modifiers.preflight import UsageError

__all__ = [
    "DEFAULT_RECIPE",
    "RECIPES_DIR",
    "available_recipes",
    "check_recipe_targets",
    "load_recipe",
    "resolve_recipe",
    "storage_layout",
]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "whisper_2of4"


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(recipe: str) -> Path:
    """A readable, non-empty recipe file: a path, or the name of one in ``recipes/``
    (e.g. ``wisp_2of4``). It is parsed by ``load_recipe``."""
    path = Path(recipe).expanduser()
    if not path.is_file():
        path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise UsageError(
            f"--recipe {recipe!r} is neither a file nor one of: {', '.join(available_recipes())}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--recipe {path} cannot be read: {error}") from error
    if not text.strip():
        raise UsageError(f"--recipe {path} is empty: it must define at least one modifier")
    return path


def load_recipe(path: Path, model) -> list:
    """The recipe's modifiers (parsed once). A group-wise quantization scheme (W4A16)
    leaves the layers it cannot quantize in 16-bit, with a warning, rather than failing
    mid-run, and a quantization modifier left with no layer to quantize is refused (it
    would exit having quantized nothing). ``model`` may be a meta-device model (only
    names and shapes are read)."""
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.recipe import Recipe

    import whisper_modifiers  # noqa: F401  (registers our modifiers by name)
    from whisper_modifiers.quantization import keep_indivisible_unquantized

    try:
        parsed = Recipe.create_instance(str(path)).modifiers
    except Exception as error:  # a YAML or modifier error, shown as the user's problem
        raise UsageError(f"--recipe {path} cannot be used: {error}") from error
    if not parsed:
        raise UsageError(
            f"--recipe {path} defines no modifier (stages are keys ending in '_stage', "
            "holding groups ending in '_modifiers'; see recipes/whisper_2of4.yaml)"
        )
    modifiers = []
    for modifier in parsed:
        if isinstance(modifier, (QuantizationModifier, GPTQModifier)):
            modifier = keep_indivisible_unquantized(modifier, model)
            if not list(match_named_modules(model, ["Linear"], modifier.ignore)):
                scheme = modifier.scheme if isinstance(modifier.scheme, str) else "config_groups"
                raise UsageError(
                    f"--recipe {path}: {type(modifier).__name__} ({scheme}) would quantize no "
                    "layer of this model: every Linear is ignored or has an input size that "
                    "is not a multiple of the group size; use a per-channel scheme (W8A8, "
                    "FP8_DYNAMIC) or config_groups with a group_size that divides the input "
                    "sizes"
                )
        modifiers.append(modifier)
    return modifiers


def check_recipe_targets(path: Path, modifiers: list, model, num_sequences: int) -> None:
    """Resolve every ``difference_targets`` of the recipe against ``model``'s modules,
    refuse a stock GPTQ after pruning (``check_mask_kept``), quantization before pruning
    and a ``gamma: auto`` with no held-out sequence."""
    from whisper_modifiers.modifiers.validation import check_mask_kept, check_prune_then_quantize

    try:
        check_mask_kept(modifiers)
        check_prune_then_quantize(modifiers)
    except ValueError as error:
        raise UsageError(f"--recipe {path}: {error}") from error
    for modifier in modifiers:
        if hasattr(modifier, "check_difference_targets"):
            try:
                modifier.check_difference_targets(model)
                modifier.check_calibration_size(num_sequences)
            except ValueError as error:
                raise UsageError(f"--recipe {path}: {type(modifier).__name__}: {error}") from error


def storage_layout(layout: str, modifiers: list) -> str:
    """``--layout`` resolved: ``compressed`` needs a pruning recipe, unquantized or
    quantized to one 8-bit value per weight (W8A8, FP8); 4-bit packed weights keep the
    dense layout (``saving.storage_layout``, what ``auto`` gives)."""
    from whisper_modifiers.saving import packs_weights, prunes
    from whisper_modifiers.saving import storage_layout as automatic

    if layout == "auto":
        return automatic(modifiers)
    packed = packs_weights(modifiers)
    if layout == "compressed" and (packed or not prunes(modifiers)):
        raise UsageError(
            "--layout compressed stores pruned weights unquantized or as 8-bit values: the "
            + (
                "recipe packs weights to fewer bits (W4A16 keeps compressed-tensors' layout)"
                if packed
                else "recipe has no pruning modifier"
            )
        )
    return layout
