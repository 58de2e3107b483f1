"""One-shot magnitude pruning: the calibration-free baseline (``S_ij = |W_ij|``)."""

from __future__ import annotations

from typing import ClassVar

import torch
from compressed_tensors.utils import (
    align_module_device,
    match_named_modules,
    update_offload_parameter,
)
from llmcompressor.core import State
from llmcompressor.modifiers.modifier import Modifier
from loguru import logger
from pydantic import Field, model_validator

from whisper_modifiers.modifiers.finalize_hook import pruning_finalized
from whisper_modifiers.modifiers.validation import (
    MaskStructure,
    NonFiniteError,
    OneSparsity,
    check_mask_kept,
    check_sparsity_fields,
    parse_mask_structure,
)
from whisper_modifiers.solvers import prune_by_score

__all__ = ["OneShotMagnitudeModifier"]


class OneShotMagnitudeModifier(Modifier):
    """Prune every targeted Linear to ``sparsity`` by weight magnitude, per output row
    (unstructured) or per group of ``M`` inputs (N:M), at initialisation; needs no
    calibration data.  (llmcompressor's ``MagnitudePruningModifier`` is a training-time
    schedule; this is the one-shot baseline of the paper's tables.)

    Sample yaml:

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        OneShotMagnitudeModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          ignore: ["lm_head"]
    ```
    """

    prunes_weights: ClassVar[bool] = True  # for the recipe-order checks (validation.py)
    sparsity: OneSparsity
    mask_structure: MaskStructure = "0:0"
    targets: str | list[str] = ["Linear"]
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])

    @model_validator(mode="after")
    def _validate_fields(self):
        check_sparsity_fields(self)
        return self

    def on_initialize(self, state: State, **kwargs) -> bool:
        check_mask_kept()  # this session's recipe
        n, m = parse_mask_structure(self.mask_structure)
        modules = [
            (name, module)
            for name, module in match_named_modules(state.model, self.targets, self.ignore)
            if isinstance(module, torch.nn.Linear)
        ]
        for name, module in modules:  # all checked before any is pruned
            with align_module_device(module):
                if not torch.isfinite(module.weight).all():
                    raise NonFiniteError(
                        f"{name}.weight holds NaN or inf; magnitude pruning would rank them "
                        "arbitrarily. Check the checkpoint and its dtype"
                    )
        for _name, module in modules:
            with torch.no_grad(), align_module_device(module):
                weight = module.weight
                scores = weight.abs().float()
                update_offload_parameter(
                    module, "weight", prune_by_score(weight, scores, self.sparsity, n, m)
                )
        logger.info(f"OneShotMagnitudeModifier pruned {len(modules)} Linear modules")
        return True

    def on_finalize(self, state: State, **kwargs) -> bool:
        pruning_finalized(state, self)  # what follows a pruning recipe (finalize_hook)
        return True
