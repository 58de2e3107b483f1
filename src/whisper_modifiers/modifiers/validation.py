"""Validation shared by our modifiers: errors name the field and the allowed values."""

from __future__ import annotations

import re
from typing import Annotated

import torch
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_base import SparsityModifierBase
from llmcompressor.modifiers.quantization import QuantizationModifier
from pydantic import AfterValidator, BeforeValidator

__all__ = [
    "NonFiniteError",
    "MaskStructure",
    "OneSparsity",
    "Sparsity",
    "check_sparsity_fields",
    "check_mask_kept",
    "check_prune_then_quantize",
    "prunes",
    "FiniteInputs",
    "check_finite_activations",
    "non_finite_activations",
    "check_finite_weights",
    "check_sparsity",
    "check_sparsity_matches_structure",
    "check_structure_divides",
    "parse_mask_structure",
]

_MASK_STRUCTURE = re.compile(r"^(\d+):(\d+)$")


class NonFiniteError(ValueError):
    """NaN or inf in a weight or a calibration activation: pruning would be meaningless."""


def check_finite_weights(model: torch.nn.Module) -> None:
    """Raise ``NonFiniteError`` naming the first parameter that holds NaN or inf."""
    for name, parameter in model.named_parameters():
        if parameter.device.type != "meta" and not torch.isfinite(parameter).all():
            count = int((~torch.isfinite(parameter)).sum())
            raise NonFiniteError(
                f"{name} holds {count} NaN or inf value(s); the model cannot be pruned "
                "(scores and Hessians would be NaN). Check the checkpoint and its dtype"
            )


def non_finite_activations(name: str) -> NonFiniteError:
    """The error for NaN or inf calibration inputs of module ``name``."""
    return NonFiniteError(
        f"{name} received NaN or inf activations; the calibration statistics would be "
        "meaningless (check the model dtype and calibration data)"
    )


def check_finite_activations(name: str, x: torch.Tensor) -> None:
    """Raise ``NonFiniteError`` if the calibration input ``x`` of module ``name`` holds
    NaN or inf (a host read: once per call)."""
    if not torch.isfinite(x).all():
        raise non_finite_activations(name)


class FiniteInputs:
    """Whether every calibration input of each module so far was finite, kept as a flag on
    the inputs' device: a hook adds to it without reading it (a read would wait for the
    device at every hooked Linear of every sequence), and ``check`` reads all of a
    layer's flags at once, before its modules are solved."""

    def __init__(self):
        self._flags: dict[torch.nn.Module, torch.Tensor] = {}

    def note(self, module: torch.nn.Module, x: torch.Tensor) -> None:
        finite = torch.isfinite(x).all()
        held = self._flags.get(module)
        self._flags[module] = finite if held is None else held & finite

    def check(self, names: dict) -> None:
        """Raise ``NonFiniteError`` naming the first module (by ``names``) whose inputs
        were not all finite; forget every flag. One host read when all were finite."""
        flags, self._flags = self._flags, {}
        if not flags:
            return
        device = next(iter(flags.values())).device
        if bool(torch.stack([flag.to(device) for flag in flags.values()]).all()):
            return
        module = next(module for module, flag in flags.items() if not bool(flag))
        raise non_finite_activations(names[module])


def check_sparsity(value):
    """``sparsity`` is a number in [0, 1), or a list of them."""
    values = value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0 <= item < 1:
            raise ValueError(
                f"sparsity must be a number in [0, 1) (or a list of them), got {value!r}"
            )
    return value


def parse_mask_structure(value) -> tuple[int, int]:
    """``mask_structure`` is ``'N:M'`` with ``0 < N < M``, or ``'0:0'`` (unstructured)."""
    match = _MASK_STRUCTURE.match(str(value).strip())
    n, m = (int(match[1]), int(match[2])) if match else (-1, -1)
    if (n, m) != (0, 0) and not 0 < n < m:
        raise ValueError(
            f"mask_structure must be 'N:M' with integers 0 < N < M (e.g. '2:4'), or '0:0' "
            f"for unstructured sparsity; got {value!r}"
        )
    return n, m


def check_sparsity_matches_structure(sparsity, n: int, m: int) -> None:
    if n and isinstance(sparsity, float) and abs(sparsity - n / m) > 1e-9:
        raise ValueError(
            f"sparsity {sparsity} contradicts mask_structure '{n}:{m}', which prunes "
            f"exactly {n / m}; set sparsity: {n / m}"
        )


def check_structure_divides(modules, n: int, m: int) -> None:
    """Every ``(name, module)`` pruned ``N:M`` has a multiple of ``M`` inputs: a partial
    last group would be pruned whole (its inputs zeroed) and the layer would not be N:M."""
    if not n:
        return
    for name, module in modules:
        inputs = getattr(module, "in_features", None)
        if inputs is not None and inputs % m:
            raise ValueError(
                f"mask_structure '{n}:{m}' needs a multiple of {m} inputs per layer, but "
                f"{name} has {inputs}; use an N:M whose M divides it, '0:0' (unstructured), "
                f"or add {name} to ignore"
            )


def _normalized_mask_structure(value) -> str:
    n, m = parse_mask_structure(value)
    return f"{n}:{m}"


def _sparsity_field(allowed):
    return Annotated[allowed, AfterValidator(check_sparsity)]


Sparsity = _sparsity_field(float | list[float] | None)
"""A pruning modifier's ``sparsity`` field: a number in [0, 1), or one per layer."""
OneSparsity = _sparsity_field(float)
"""A ``sparsity`` field that takes one number in [0, 1)."""
MaskStructure = Annotated[str, BeforeValidator(_normalized_mask_structure)]
"""A ``mask_structure`` field: ``'N:M'`` with ``0 < N < M``, or ``'0:0'``."""


def check_sparsity_fields(modifier) -> None:
    """A modifier's ``sparsity`` agrees with its ``mask_structure``."""
    check_sparsity_matches_structure(
        modifier.sparsity, *parse_mask_structure(modifier.mask_structure)
    )


# ---- the order of a recipe's modifiers ---------------------------------------------------


def prunes(modifier) -> bool:
    """Whether ``modifier`` prunes weights: llmcompressor's sparsity modifiers (and so all
    of ours built on them), or a modifier that says so (``prunes_weights``)."""
    return isinstance(modifier, SparsityModifierBase) or getattr(modifier, "prunes_weights", False)


def check_mask_kept(modifiers: list | None = None) -> None:
    """Raise ``ValueError`` if a stock ``GPTQModifier`` comes after a pruning modifier in
    ``modifiers`` (default: the recipe of llmcompressor's active session, as a pruning
    modifier sees it in ``on_initialize``)."""
    if modifiers is None:
        from llmcompressor.core import active_session

        modifiers = active_session().lifecycle.recipe.modifiers
    pruner = None
    for modifier in modifiers:
        if prunes(modifier):
            pruner = modifier
        elif pruner is not None and type(modifier) is GPTQModifier:
            raise ValueError(
                f"GPTQModifier follows {type(pruner).__name__} in this recipe: stock GPTQ "
                "moves pruned weights off zero, breaking the sparsity pattern (2:4 "
                "included). Use MaskedGPTQModifier (the same fields), which keeps the mask"
            )


def check_prune_then_quantize(modifiers: list) -> None:
    """Refuse a quantization modifier before a pruning one: pruning would then zero
    quantized weights under scales fitted to the dense ones (or, for a packed scheme,
    find no float weight to prune)."""
    for index, modifier in enumerate(modifiers):
        later = [m for m in modifiers[index + 1 :] if prunes(m)]
        if isinstance(modifier, (QuantizationModifier, GPTQModifier)) and later:
            raise ValueError(
                f"{type(modifier).__name__} comes before {type(later[0]).__name__}; prune "
                "first, then quantize (put the quantization modifier after the pruning one)"
            )
