"""What Wisp, Wisp+ and Whisper share: llmcompressor's ``SparsityModifierBase`` plus the
parts a difference modifier holds:

* its statistics (``calibration_statistics``): float64 sums per module, reduced across
  ranks before each layer is solved;
* its pairing (``pairing``): differences within each calibration sequence, or within
  each sequence's tokens routed to an MoE expert, or the centered form;
* under ``gamma: auto``, its selection (``gamma_auto``, with its ``model_check``).

``difference_targets`` routes each pruned module to the difference statistic or to the
parent's standard method inside the same modifier (``targets``). A method subclass
implements ``calibrate_module``, ``compress_modules`` and ``candidate_weight``.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import torch
from compressed_tensors.utils import match_named_modules
from llmcompressor.core import Event, State
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_base import SparsityModifierBase
from loguru import logger
from pydantic import Field, PrivateAttr, model_validator

from whisper_modifiers.modifiers.calibration_statistics import CalibrationStatistics
from whisper_modifiers.modifiers.causal_mask import watch_causal_masks
from whisper_modifiers.modifiers.distributed import sequence_offset
from whisper_modifiers.modifiers.finalize_hook import pruning_finalized
from whisper_modifiers.modifiers.gamma_auto import GammaAuto
from whisper_modifiers.modifiers.pairing import Pairing
from whisper_modifiers.modifiers.targets import (
    DEFAULT_DIFFERENCE_TARGETS,
    DEFAULT_IGNORE,
    pruned_modules,
    select_difference_modules,
)
from whisper_modifiers.modifiers.validation import (
    FiniteInputs,
    MaskStructure,
    Sparsity,
    check_mask_kept,
    check_sparsity_fields,
)

__all__ = ["DEFAULT_DIFFERENCE_TARGETS", "DEFAULT_IGNORE", "DifferencePruningBase", "Gamma"]

Gamma = Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"]
"""A mixing weight in [0, 1], or ``"auto"``: chosen per module (``gamma_auto``)."""


class DifferencePruningBase(SparsityModifierBase):
    """Fields common to Wisp, Wisp+ and Whisper; each is described in docs/fields.md.

    ``difference_targets`` (module patterns given the difference statistic; the default
    reaches the gate and up projections of gated MLPs, MoE experts included), ``seed``,
    ``num_permutations`` and ``pairing`` (the pairs, paper Section 3.1 and appendix
    "Sampling approach details"), ``gamma`` (the mixture with the standard statistic, or
    ``"auto"``) and ``gamma: auto``'s ``gamma_candidates``, ``holdout_every``,
    ``gamma_folds``, ``gamma_evidence``, ``gamma_criterion`` and ``gamma_model_check``;
    ``ignore`` defaults to the LM head and MoE routers.
    """

    GAMMA_CANDIDATES: ClassVar[tuple[float, ...]] = ()

    sparsity: Sparsity
    mask_structure: MaskStructure = "0:0"
    difference_targets: list[str] = Field(default_factory=lambda: list(DEFAULT_DIFFERENCE_TARGETS))
    seed: int = Field(default=0, ge=0)
    num_permutations: int = Field(default=1, ge=1)
    pairing: Literal["random", "nearest", "centered"] = "random"
    ignore: list[str] = Field(default_factory=lambda: list(DEFAULT_IGNORE))
    gamma: Gamma = 0.0
    gamma_candidates: list[Annotated[float, Field(ge=0.0, le=1.0)]] | None = None
    holdout_every: int = Field(default=4, ge=2)
    gamma_folds: int = Field(default=1, ge=1)
    gamma_evidence: float = Field(default=2.0, ge=0.0)
    gamma_criterion: Literal["relative", "absolute"] = "relative"
    gamma_model_check: bool = True

    _statistics: CalibrationStatistics = PrivateAttr(default_factory=CalibrationStatistics)
    _pairs: Pairing | None = PrivateAttr(default=None)
    _gamma_auto: GammaAuto | None = PrivateAttr(default=None)
    _difference_modules: set[torch.nn.Module] = PrivateAttr(default_factory=set)
    _sequences_seen: dict[torch.nn.Module, int] = PrivateAttr(default_factory=dict)
    _calibrated: set[torch.nn.Module] = PrivateAttr(default_factory=set)
    _finite: FiniteInputs = PrivateAttr(default_factory=FiniteInputs)

    @model_validator(mode="after")
    def _validate_fields(self):
        check_sparsity_fields(self)
        if self.pairing != "random" and self.num_permutations != 1:
            raise ValueError(
                f"num_permutations applies to pairing 'random' only; pairing "
                f"{self.pairing!r} takes num_permutations: 1"
            )
        if self.gamma_candidates is not None:
            if self.gamma != "auto":
                raise ValueError(
                    f"gamma_candidates applies to gamma 'auto' only; gamma is {self.gamma!r}"
                )
            if not self.gamma_candidates or len(set(self.gamma_candidates)) < len(
                self.gamma_candidates
            ):
                raise ValueError(
                    f"gamma_candidates must be a non-empty list of distinct values in "
                    f"[0, 1], got {self.gamma_candidates}"
                )
        if self.gamma_folds > self.holdout_every:
            raise ValueError(
                f"gamma_folds must be between 1 and holdout_every ({self.holdout_every}), "
                f"got {self.gamma_folds}"
            )
        return self

    # -- checks before any work --------------------------------------------------------

    def check_difference_targets(self, model: torch.nn.Module) -> list[str]:
        """Resolve ``difference_targets`` against ``model`` (a meta-device model will do:
        only names and types are read) before any calibration; raises the same errors as
        calibration would. Returns the names of the difference modules."""
        modules = self._pruned_modules(dict(match_named_modules(model, self.targets)))
        selected = select_difference_modules(modules, self.difference_targets)
        return [name for name, module, _ in modules if module in selected]

    def check_calibration_size(self, num_sequences: int) -> None:
        """Refuse ``gamma: auto`` on fewer sequences than one held out (before any work)."""
        if self.gamma == "auto" and self.difference_targets and num_sequences < self.holdout_every:
            raise ValueError(
                f"gamma 'auto' holds out every {self.holdout_every}th calibration sequence "
                f"(holdout_every) and needs at least {self.holdout_every} sequences; got "
                f"{num_sequences}"
            )

    def new_statistics(self) -> CalibrationStatistics:
        """An empty statistics object for a run (a method may keep its Grams offloaded)."""
        return CalibrationStatistics()

    def _pruned_modules(self, target_layers: dict) -> list[tuple]:
        return pruned_modules(target_layers, self.sparsity, self.ignore, self.mask_structure)

    # -- calibration -------------------------------------------------------------------

    def on_initialize(self, state: State, **kwargs) -> bool:
        check_mask_kept()  # this session's recipe
        self._statistics = self.new_statistics()
        self._pairs = Pairing(
            self.pairing, self.seed, self.num_permutations, self._module_names, type(self).__name__
        )
        self._gamma_auto = None
        if self.gamma == "auto":
            self._gamma_auto = GammaAuto(
                self,
                list(self.gamma_candidates or self.GAMMA_CANDIDATES),
                self._module_names,
                self.holdout_every,
                self.gamma_folds,
                self.gamma_evidence,
                self.gamma_criterion,
                self.gamma_model_check,
            )
        return super().on_initialize(state, **kwargs)

    def on_calibration_start(self, state: State, event: Event, **kwargs):
        """Register the calibration hooks (llmcompressor's loop, with clean names)."""
        modules = self._pruned_modules(self._target_layers)
        self._difference_modules = select_difference_modules(modules, self.difference_targets)
        for name, module, sparsity in modules:
            if name.endswith("lm_head"):
                logger.warning(
                    f"{type(self).__name__} will prune {name}; add it to `ignore` to keep "
                    "the LM head dense (the paper does not prune it)"
                )
            self._module_names[module] = name
            self._module_sparsities[module] = sparsity
            self.register_hook(module, self._calibrate_finite, "forward")
        differences = [(n, m) for n, m, _ in modules if m in self._difference_modules]
        refused = {
            "gamma: auto": self.gamma == "auto",
            "pairing: centered": self.pairing == "centered",
        }
        self._pairs.watch_routing(state.model, differences, self.register_hook, refused)
        watch_causal_masks(state.model, self.register_hook)
        if self._gamma_auto is not None:
            self._gamma_auto.start(state.model, modules)
        logger.info(
            f"{type(self).__name__}: difference statistic on "
            f"{len(self._difference_modules)} of {len(modules)} modules"
        )

    def _calibrate_finite(self, module, args, output):
        """``calibrate_module``, noting whether the inputs are finite (every module,
        routed to the difference statistic or to the standard method; NaN or inf is
        refused, naming the module, before the layer is solved: ``reduce_and_select``).
        With ``gamma: auto`` the held-out sequences of a difference module are also kept
        (``gamma_auto``)."""
        x = args[0]
        self._finite.note(module, x)
        first = self._sequences_seen.get(module, sequence_offset())  # global index
        rows = list(range(first, first + self._pairs.batch_size(module, x)))
        self._sequences_seen[module] = rows[-1] + 1
        self._calibrated.add(module)
        if self._gamma_auto is not None and self.is_difference_module(module):
            self._gamma_auto.hold_out(module, x, rows)
        self._pairs.rows = rows
        return self.calibrate_module(module, args, output)

    def calibrate_held_out(self, module: torch.nn.Module, batch: torch.Tensor, row: int):
        """``calibrate_module`` on one held-out sequence again (``gamma_auto``)."""
        self._pairs.rows = [row]
        self.calibrate_module(module, (batch,), None)

    def swap_statistics(self, statistics: CalibrationStatistics) -> CalibrationStatistics:
        held, self._statistics = self._statistics, statistics
        return held

    def is_difference_module(self, module: torch.nn.Module) -> bool:
        return module in self._difference_modules

    # -- solving -------------------------------------------------------------------------

    def gamma_of(self, module: torch.nn.Module) -> float:
        """The gamma ``module`` is solved with: ``gamma`` or its choice under ``auto``; 1
        (the standard statistic alone) outside ``difference_targets``."""
        if not self.is_difference_module(module):
            return 1.0
        return self._gamma_auto.chosen[module] if self._gamma_auto is not None else self.gamma

    def reduce_and_select(self) -> None:
        """Refuse NaN or inf calibration inputs of this layer (``FiniteInputs.check``);
        reduce the statistics across ranks; under ``gamma: auto``, choose this layer's
        gammas first (``GammaAuto.reduce_and_select``)."""
        self._finite.check(self._module_names)
        if self._gamma_auto is None or not self._difference_modules:
            return self._statistics.reduce(self._module_names)
        self._gamma_auto.reduce_and_select(self._statistics, self._calibrated)

    def candidate_weight(self, module: torch.nn.Module, gamma: float) -> torch.Tensor:
        """``module``'s pruned weight at ``gamma`` from the statistics held now, which
        stay as they are (each method's solver)."""
        raise NotImplementedError

    def candidate_weights(self, group: list, gammas: list[float]) -> list[dict]:
        """Per gamma, ``{module: pruned weight}`` for the modules of ``group`` (one
        ``candidate_weight`` each; a method may solve them together)."""
        return [
            {module: self.candidate_weight(module, gamma) for module in group} for gamma in gammas
        ]

    def on_sequential_epoch_end(self, state: State, event: Event, **kwargs):
        self._pairs.end_layer()
        super().on_sequential_epoch_end(state, event, **kwargs)  # compress_modules
        if self._gamma_auto is not None:
            self._gamma_auto.end_layer(self._calibrated)
        self._calibrated = set()

    def on_calibration_end(self, state: State, event: Event, **kwargs):
        """After the last layer: ``gamma: auto``'s model check (``model_check``)."""
        if self._gamma_auto is not None:
            self._gamma_auto.end_calibration(state.model, state.data.calib)
        super().on_calibration_end(state, event, **kwargs)

    # -- after the run -------------------------------------------------------------------

    def gamma_selection(self) -> dict[str, dict]:
        """Under ``gamma: auto``, per difference module: the chosen ``gamma`` and each
        candidate's ``held_out_error``; kept after the run (empty otherwise)."""
        record = self._gamma_auto.record if self._gamma_auto is not None else {}
        return {name: dict(choice) for name, choice in record.items()}

    def routing_skips(self) -> dict[str, tuple[int, int]]:
        """``{expert module: (sequences with fewer than 2 routed tokens, sequences)}`` of
        the last calibration (the modules that drew the pairs: an expert's gate)."""
        return self._pairs.routing_skips() if self._pairs is not None else {}

    def on_finalize(self, state: State, **kwargs) -> bool:
        if len(self._statistics):
            raise ValueError(f"Failed to compress {len(self._statistics)} modules")
        if self._gamma_auto is not None:
            self._gamma_auto.release()  # keeps the record
        if self._pairs is not None:
            self._pairs.release()  # keeps the routing skips
        self._statistics = CalibrationStatistics()
        self._difference_modules, self._sequences_seen, self._calibrated = set(), {}, set()
        finalized = super().on_finalize(state, **kwargs)
        pruning_finalized(state, self)  # what follows a pruning recipe (finalize_hook)
        return finalized
