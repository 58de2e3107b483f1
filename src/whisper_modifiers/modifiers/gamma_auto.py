"""``gamma: auto``: gamma chosen per difference module on held-out calibration sequences.

The maths is ``selection.py``'s (the block output error of each candidate, the evidence
rule); this mixin is its calibration glue for ``DifferencePruningBase``:

* every sequence calibrates the statistics as in the baseline (the final solve uses
  them); the inputs of the sequences of the measured folds are also kept (``hold_out``);
* after the layer's forward passes, ``reduce_and_select`` replays each measured fold
  into statistics of its own. For each measured fold it takes the statistics of every
  other sequence (all, less the fold's) and measures each candidate on the fold; then it
  chooses each group's gamma from all folds' errors: a gated MLP's gate and up
  projections together, by the error of the MLP block's output
  (``selection.select_gamma``);
* a group whose choice left gamma 1 is solved and propagated at gamma 1 until the model
  check (``model_check``) decides, after the last layer, whether its chosen weights
  replace the baseline's;
* ``gamma_selection()`` and whisper-prune's record keep the choices.

It relies on the host modifier's routing (``is_difference_module``, ``_module_names``,
``calibrate_module``, ``_rows``, ``_difference_modules``, ``_calibrated``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Annotated, ClassVar, Literal

import torch
from compressed_tensors.utils import align_module_device, get_execution_device
from llmcompressor.core import Event, State
from loguru import logger
from pydantic import Field, PrivateAttr, model_validator

from whisper_modifiers.modifiers.distributed import (
    all_reduce_sum,
    reduce_statistics,
    statistic_names,
)
from whisper_modifiers.modifiers.model_check import ModelCheck
from whisper_modifiers.modifiers.statistic_sets import (
    copy_statistics,
    restored_statistics,
    statistics_without,
)
from whisper_modifiers.selection import (
    gated_mlp_errors,
    held_out_fold,
    held_out_tokens,
    output_errors,
    select_gamma,
)

__all__ = ["GATED_MLP_PARTS", "Gamma", "GammaAuto"]

GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")

Gamma = Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"]
"""A mixing weight in [0, 1], or ``"auto"``: chosen per module (``selection``)."""


class GammaAuto(ModelCheck):
    """The ``gamma`` fields of a difference modifier and ``gamma: auto``'s selection
    (the fields are documented on ``DifferencePruningBase``)."""

    GAMMA_CANDIDATES: ClassVar[tuple[float, ...]] = ()

    gamma: Gamma = 0.0
    gamma_candidates: list[Annotated[float, Field(ge=0.0, le=1.0)]] | None = None
    holdout_every: int = Field(default=4, ge=2)
    gamma_folds: int = Field(default=1, ge=1)
    gamma_evidence: float = Field(default=2.0, ge=0.0)
    gamma_criterion: Literal["relative", "absolute"] = "relative"

    _held_of_input: tuple | None = PrivateAttr(default=None)
    _held_inputs: dict[torch.nn.Module, list] = PrivateAttr(default_factory=dict)
    _gated_mlps: dict[torch.nn.Module, torch.nn.Module] = PrivateAttr(default_factory=dict)
    _chosen_gammas: dict[torch.nn.Module, float] = PrivateAttr(default_factory=dict)
    _gamma_record: dict[str, dict] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _validate_gamma_candidates(self):
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

    def check_calibration_size(self, num_sequences: int) -> None:
        """Refuse ``gamma: auto`` on fewer sequences than one held out (before any work)."""
        if self.gamma == "auto" and self.difference_targets and num_sequences < self.holdout_every:
            raise ValueError(
                f"gamma 'auto' holds out every {self.holdout_every}th calibration sequence "
                f"(holdout_every) and needs at least {self.holdout_every} sequences; got "
                f"{num_sequences}"
            )

    def candidate_gammas(self) -> list[float]:
        """What ``gamma: auto`` chooses from."""
        return list(self.gamma_candidates or self.GAMMA_CANDIDATES)

    def find_gated_mlps(self, model: torch.nn.Module, modules: list[tuple]) -> None:
        """Record the gated MLP each pruned gate / up projection is part of (its gamma is
        chosen with its partner's, by the block's output error)."""
        for name, module, _ in modules:
            parent = model.get_submodule(name.rpartition(".")[0])
            if all(hasattr(parent, part) for part in GATED_MLP_PARTS) and module in (
                parent.gate_proj,
                parent.up_proj,
            ):
                self._gated_mlps[module] = parent

    def hold_out(self, module: torch.nn.Module, x: torch.Tensor, rows: list[int]):
        """Keep the held-out sequences of a hook's input for the selection (they are
        calibrated on too, with every other sequence)."""
        self._held_inputs.setdefault(module, []).extend(self._held_sequences(x, rows))

    def _held_sequences(self, x: torch.Tensor, rows: list[int]) -> list[tuple]:
        """``[(index, held-out sequence)]`` of a hook's input, copied to the CPU once per
        input tensor, so that modules sharing their input (gate and up) share the very
        tensors (``_replay``)."""
        cached = self._held_of_input
        if cached is not None and cached[0]() is x and cached[1] == x._version:
            return cached[2]
        sequences = x if x.dim() == 3 else x.unsqueeze(0)
        held = [(row, sequences[b].detach().to("cpu", copy=True))
                for b, row in enumerate(rows) if self._fold_of(row) is not None]  # fmt: skip
        self._held_of_input = (weakref.ref(x), x._version, held)
        return held

    def _fold_of(self, row: int) -> int | None:
        return held_out_fold(row, self.holdout_every, self.gamma_folds)

    def gamma_of(self, module: torch.nn.Module) -> float:
        """The gamma ``module`` is solved with: ``gamma`` or its choice under ``auto``; 1
        (the standard statistic alone) outside ``difference_targets``."""
        if not self.is_difference_module(module):
            return 1.0
        return self._chosen_gammas[module] if self.gamma == "auto" else self.gamma

    def gamma_selection(self) -> dict[str, dict]:
        """Under ``gamma: auto``, per difference module: the chosen ``gamma`` and each
        candidate's ``held_out_error``; kept after the run (empty otherwise)."""
        return {name: dict(choice) for name, choice in self._gamma_record.items()}

    def candidate_weight(self, module: torch.nn.Module, gamma: float) -> torch.Tensor:
        """``module``'s pruned weight at ``gamma`` from the statistics held now, which
        stay as they are (each method's solver)."""
        raise NotImplementedError

    def candidate_weights(self, group: list, gammas: list[float]) -> list[dict]:
        """Per gamma, ``{module: pruned weight}`` for the modules of ``group`` (one
        ``candidate_weight`` each; a method may solve them together)."""
        return [{module: self.candidate_weight(module, gamma) for module in group}
                for gamma in gammas]  # fmt: skip

    def reduce_and_select(self):
        """Reduce the statistics across ranks (``distributed``): every calibration
        sequence, held out or not, summed in the order the baseline sums them, so a
        module that keeps gamma 1 is the baseline's bit for bit. Under ``gamma: auto``
        each difference module's gamma is chosen fold by fold with the statistics of
        every other sequence (all of them less the fold's, reduced alike)."""
        if self.gamma != "auto" or not self._difference_modules:
            return reduce_statistics(self)
        selecting = self._difference_modules & self._calibrated
        names = [name for name in statistic_names() if getattr(self, name, None) is not None]
        everything = {name: copy_statistics(getattr(self, name), selecting) for name in names}
        held = self._held_inputs
        folds = self._replay(held, names)
        reduce_statistics(self)  # every sequence, summed as the baseline sums them
        groups = self._selection_groups(held)
        errors = {index: [] for index in range(len(groups))}
        with restored_statistics(self, names):
            for fold in sorted(folds):
                for name in names:
                    setattr(self, name, statistics_without(everything, folds[fold], name))
                reduce_statistics(self)
                for index, (group, mlp) in enumerate(groups):
                    errors[index].append(self._fold_errors(group, mlp, held, fold))
        reference = max(self.candidate_gammas())
        for index, (group, _) in enumerate(groups):
            chosen = self._choose(group, errors[index])
            if chosen != reference:
                self.defer_choice(group, chosen, reference)  # model_check

    def _replay(self, held: dict[torch.nn.Module, list], names: list[str]) -> dict[int, dict]:
        """Calibrate on the held-out sequences again, in index order, each module in
        registration order, into statistics of their fold alone (``{fold: {name:
        {module: sum}}}``); modules that shared an input share it again."""
        self._held_inputs = dict()
        sequences = {}
        for module in self._module_names:
            for row, sequence in held.get(module, []):
                sequences.setdefault(id(sequence), (row, sequence, []))[2].append(module)
        folds = {}
        with restored_statistics(self, names):
            for row, sequence, modules in sorted(sequences.values(), key=lambda item: item[0]):
                fold = folds.setdefault(self._fold_of(row), {name: {} for name in names})
                for name in names:
                    setattr(self, name, fold[name])
                batch = sequence.unsqueeze(0).to(get_execution_device(modules[0]))
                for module in modules:
                    self._rows = [row]
                    self.calibrate_module(module, (batch,), None)
        for fold in range(self.holdout_every - self.gamma_folds, self.holdout_every):
            folds.setdefault(fold, {name: {} for name in names})  # none on this rank
        return folds

    def _selection_groups(self, held: dict[torch.nn.Module, list]) -> list[tuple]:
        """``(group, gated MLP or None)`` per group of difference modules calibrated in
        this layer that shares one gamma: a gated MLP's gate and up projections together,
        any other module alone."""
        groups, done = [], set()
        for module in self._module_names:
            if module in done or module not in self._calibrated:
                continue  # grouped already, or not in this layer
            if not self.is_difference_module(module):
                continue
            mlp = self._gated_mlps.get(module)
            group = [module]
            if mlp is not None:
                group = [m for m in (mlp.gate_proj, mlp.up_proj) if self.is_difference_module(m)]
            done.update(group)
            if all_reduce_sum(len(held.get(group[0], []))) == 0:
                raise ValueError(
                    f"gamma 'auto' holds out every {self.holdout_every}th calibration "
                    f"sequence, and {self._module_names[module]} saw none: calibrate on at "
                    f"least {self.holdout_every} sequences (or lower holdout_every)"
                )
            groups.append((group, mlp))
        return groups

    def _fold_errors(self, group, mlp, held, fold: int) -> torch.Tensor:
        """``[candidates, sequences]``: each candidate's error on this rank's held-out
        sequences of ``fold``, pruned with the statistics held now (the other folds')."""
        inputs = [
            held_out_tokens(sequence, row, self.holdout_every, self.gamma_folds)
            for row, sequence in held.get(group[0], []) if self._fold_of(row) == fold
        ]  # fmt: skip
        pruned = self.candidate_weights(group, self.candidate_gammas())
        return self._held_out_errors(group, mlp, inputs, pruned)

    def _choose(self, group: list, fold_errors: list[torch.Tensor]) -> float:
        """Choose, record and return ``group``'s gamma from every fold's errors."""
        best, errors, standard_errors, fold_choices = select_gamma(
            self.candidate_gammas(), fold_errors, self.gamma_evidence, all_reduce_sum
        )
        for module in group:
            self._chosen_gammas[module] = best
            self._gamma_record[self._module_names[module]] = {
                "gamma": best,
                "chosen_gamma": best,
                "held_out_error": {str(gamma): error for gamma, error in errors.items()},
                "difference_se": {str(g): se for g, se in standard_errors.items()},
                "fold_gammas": fold_choices,
            }
        logger.info(
            f"{', '.join(self._module_names[m] for m in group)}: gamma {best} "
            f"(mean held-out error {errors[best]:.4g}; candidates {errors}, standard "
            f"errors of their difference to {max(errors)} {standard_errors}; each fold "
            f"alone: {fold_choices})"
        )
        return best

    def _held_out_errors(self, group, mlp, inputs, candidates: list[dict]) -> torch.Tensor:
        """Each candidate's gated MLP block output error (or the module's own) on each of
        this rank's held-out sequences, ``[candidates, sequences]``."""
        parts = [mlp.gate_proj, mlp.up_proj, mlp.down_proj] if mlp is not None else group
        with contextlib.ExitStack() as stack:
            for part in parts:
                stack.enter_context(align_module_device(part))
            if mlp is None:
                (module,) = group
                return output_errors(inputs, module.weight, [c[module] for c in candidates],
                                     self.gamma_criterion)  # fmt: skip
            gate, up = mlp.gate_proj, mlp.up_proj
            return gated_mlp_errors(
                inputs, gate.weight, up.weight, mlp.down_proj.weight, mlp.act_fn,
                [(c.get(gate, gate.weight), c.get(up, up.weight)) for c in candidates],
                self.gamma_criterion,
            )  # fmt: skip

    def on_sequential_epoch_end(self, state: State, event: Event, **kwargs):
        self._held_of_input = None  # release the layer's last batch
        solved = set(self._calibrated)
        super().on_sequential_epoch_end(state, event, **kwargs)
        if self.gamma == "auto":
            self.watch_layer_propagation(solved)  # model_check

    def on_calibration_end(self, state: State, event: Event, **kwargs):
        """After the last layer: ``gamma: auto``'s model check (``model_check``)."""
        if self.gamma == "auto":
            self.check_model(state.model, state.data.calib)
        super().on_calibration_end(state, event, **kwargs)

    def _reset_gamma_auto(self):
        self._held_of_input = None
        self._held_inputs = dict()
        self._gated_mlps = dict()
        self._chosen_gammas = dict()
        self._reset_model_check()
