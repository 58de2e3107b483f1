"""Pruning chained with quantization in one recipe (pruning first).

``chained_recipe("whisper", "W8A8", model)`` returns ``[WhisperModifier(2:4),
QuantizationModifier(W8A8)]``.  Zeros stay zeros under the symmetric schemes used here
(W8A8 int8, FP8_DYNAMIC, W4A16), so the 2:4 pattern survives quantization.  Group-wise
schemes (W4A16, group 128) cannot quantize a layer whose input size is not a multiple of
the group size; ``indivisible_layers`` finds them and the chain keeps them in
16-bit, saying so, instead of failing.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme
from compressed_tensors.utils import match_named_modules
from llmcompressor.modifiers.quantization import QuantizationModifier
from loguru import logger

from whisper_modifiers.methods import build_recipe

__all__ = [
    "SCHEMES",
    "chained_recipe",
    "indivisible_layers",
    "keep_indivisible_unquantized",
    "quantization_modifier",
]

SCHEMES = ("W8A8", "FP8_DYNAMIC", "W4A16")


def indivisible_layers(model: torch.nn.Module, scheme: str, ignore=("lm_head",)) -> list[str]:
    """Linear layers a group-wise ``scheme`` cannot quantize (input size not a multiple
    of the group size: llmcompressor 0.14's observer fails on them, smaller ones
    included); empty for per-channel/per-tensor schemes."""
    weights = preset_name_to_scheme(scheme, ["Linear"]).weights
    if weights is None or weights.strategy not in (
        QuantizationStrategy.GROUP,
        QuantizationStrategy.TENSOR_GROUP,
    ):
        return []
    group = int(weights.group_size)
    return [
        name
        for name, module in match_named_modules(model, ["Linear"], list(ignore))
        if module.in_features % group
    ]


def keep_indivisible_unquantized(modifier, model: torch.nn.Module):
    """``modifier`` (a ``QuantizationModifier`` or a GPTQ modifier) with the layers its
    scheme cannot quantize added to ``ignore`` (they
    stay in 16-bit), with a warning that names them.  A new modifier is built: the
    modifier caches its resolved configuration, so editing ``ignore`` in place is unsafe."""
    if not isinstance(modifier.scheme, str) or modifier.scheme not in SCHEMES:
        return modifier
    kept = indivisible_layers(model, modifier.scheme, modifier.ignore)
    if not kept:
        return modifier
    logger.warning(
        f"{modifier.scheme}: {len(kept)} layers have an input size that is not a multiple "
        f"of the group size and stay unquantized: {', '.join(kept[:6])}"
        + (" ..." if len(kept) > 6 else "")
    )
    fields = modifier.model_dump(exclude_unset=True) | {"ignore": [*modifier.ignore, *kept]}
    return type(modifier).model_validate(fields)


def quantization_modifier(
    scheme: str, model: torch.nn.Module | None = None, ignore=("lm_head",)
) -> QuantizationModifier:
    """llmcompressor's ``QuantizationModifier`` for ``scheme`` on every Linear but
    ``ignore``; with ``model``, layers the scheme cannot quantize stay in 16-bit."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    modifier = QuantizationModifier(targets=["Linear"], scheme=scheme, ignore=list(ignore))
    return modifier if model is None else keep_indivisible_unquantized(modifier, model)


def chained_recipe(
    method: str,
    scheme: str,
    model: torch.nn.Module | None = None,
    sparsity: float = 0.5,
    mask_structure: str = "2:4",
    seed: int = 0,
    **options,
) -> list:
    """Prune with ``method`` (a ``methods.METHODS`` name), then quantize with ``scheme``."""
    return [
        *build_recipe(method, sparsity, mask_structure, seed, **options),
        quantization_modifier(scheme, model),
    ]
