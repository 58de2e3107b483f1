"""``gamma: auto``: gamma chosen per difference module on held-out calibration sequences
(a part a difference modifier holds; its fields are ``DifferencePruningBase``'s).

The maths is ``selection.py``'s (the block output error of each candidate, the evidence
rule); this is its calibration glue:

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
* ``record`` (the modifier's ``gamma_selection()``, whisper-prune's record) keeps the
  choices.

What it needs of its modifier is ``GammaAutoHost``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Protocol

import torch
from compressed_tensors.utils import align_module_device, get_execution_device
from loguru import logger

from whisper_modifiers.modifiers.calibration_statistics import CalibrationStatistics
from whisper_modifiers.modifiers.distributed import all_reduce_sum
from whisper_modifiers.modifiers.model_check import ModelCheck
from whisper_modifiers.selection import (
    gated_mlp_errors,
    held_out_fold,
    held_out_tokens,
    output_errors,
    select_gamma,
)

__all__ = ["GATED_MLP_PARTS", "GammaAuto", "GammaAutoHost"]

GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


class GammaAutoHost(Protocol):
    """What ``GammaAuto`` needs of the modifier that holds it."""

    def is_difference_module(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` gets the difference statistic (and so a gamma)."""

    def candidate_weights(self, group: list, gammas: list[float]) -> list[dict]:
        """Per gamma, ``{module: pruned weight}`` of ``group`` from the statistics held
        now, which stay as they are."""

    def calibrate_held_out(self, module: torch.nn.Module, batch: torch.Tensor, row: int):
        """Add one held-out sequence (global index ``row``) to the statistics held now."""

    def swap_statistics(self, statistics: CalibrationStatistics) -> CalibrationStatistics:
        """Hold ``statistics`` from now on; return those held until now."""


class GammaAuto:
    """``gamma: auto``'s selection for ``host`` (module docstring).

    :param candidates: the gammas to choose from (the largest is the reference).
    :param module_names: the host's ``{module: name}``, in registration order.
    """

    def __init__(
        self,
        host: GammaAutoHost,
        candidates: list[float],
        module_names: dict[torch.nn.Module, str],
        holdout_every: int,
        gamma_folds: int,
        gamma_evidence: float,
        gamma_criterion: str,
        gamma_model_check: bool,
    ):
        self.host, self.candidates, self.module_names = host, candidates, module_names
        self.holdout_every, self.gamma_folds = holdout_every, gamma_folds
        self.gamma_evidence, self.gamma_criterion = gamma_evidence, gamma_criterion
        self.chosen: dict[torch.nn.Module, float] = {}  # the gamma each module is solved with
        self.record: dict[str, dict] = {}  # per module name: choice, errors, model check
        self.model_check = ModelCheck(self) if gamma_model_check else None
        self._gated_mlps: dict[torch.nn.Module, torch.nn.Module] = {}
        self._held_inputs: dict[torch.nn.Module, list] = {}
        self._held_of_input: tuple | None = None

    def start(self, model: torch.nn.Module, modules: list[tuple]) -> None:
        """At calibration start, for the pruned ``(name, module, sparsity)``: record the
        gated MLP each gate / up projection is part of (its gamma is chosen with its
        partner's, by the block's output error), and have the model check watch the
        propagation."""
        for name, module, _ in modules:
            parent = model.get_submodule(name.rpartition(".")[0])
            if all(hasattr(parent, part) for part in GATED_MLP_PARTS) and module in (
                parent.gate_proj,
                parent.up_proj,
            ):
                self._gated_mlps[module] = parent
        if self.model_check is not None:
            self.model_check.watch_propagation(model)

    def end_layer(self, solved: set[torch.nn.Module]) -> None:
        """After a layer's solve (``solved``: its modules)."""
        if self.model_check is not None:
            self.model_check.watch_layer_propagation(solved)

    def end_calibration(self, model: torch.nn.Module, dataloader) -> None:
        """After the last layer: the model check, if on."""
        if self.model_check is not None:
            self.model_check.check_model(model, dataloader)

    def fold_of(self, row: int) -> int | None:
        """The measured fold of the sequence with global index ``row``, or None."""
        return held_out_fold(row, self.holdout_every, self.gamma_folds)

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
        held = [
            (row, sequences[b].detach().to("cpu", copy=True))
            for b, row in enumerate(rows)
            if self.fold_of(row) is not None
        ]
        self._held_of_input = (weakref.ref(x), x._version, held)
        return held

    def release(self) -> None:
        """Forget everything but ``record`` (the end of the run)."""
        if self.model_check is not None:
            self.model_check.stop_watching()
        self._gated_mlps, self._held_inputs, self._held_of_input = {}, {}, None

    def reduce_and_select(self, statistics: CalibrationStatistics, calibrated: set) -> None:
        """Reduce ``statistics`` (the host's, every calibration sequence, held out or not,
        summed as the baseline sums them: a module that keeps gamma 1 is the baseline's
        bit for bit) and choose each difference module of this layer (``calibrated``) its
        gamma, fold by fold, with the statistics of every other sequence (all of them less
        the fold's, reduced alike)."""
        selecting = {m for m in calibrated if self.host.is_difference_module(m)}
        everything = statistics.copy(selecting)
        held, self._held_inputs, self._held_of_input = self._held_inputs, dict(), None
        folds = self._replay(held)
        statistics.reduce(self.module_names)
        groups = self._selection_groups(held, calibrated)
        errors = {index: [] for index in range(len(groups))}
        try:
            for fold in sorted(folds):
                remaining = everything.without(folds[fold])
                remaining.reduce(self.module_names)
                self.host.swap_statistics(remaining)
                for index, (group, mlp) in enumerate(groups):
                    errors[index].append(self._fold_errors(group, mlp, held, fold))
        finally:
            self.host.swap_statistics(statistics)
        reference = max(self.candidates)
        for index, (group, _) in enumerate(groups):
            chosen = self._choose(group, errors[index])
            if chosen != reference and self.model_check is not None:
                self.model_check.defer_choice(group, chosen, reference)

    def _replay(self, held: dict[torch.nn.Module, list]) -> dict[int, CalibrationStatistics]:
        """Calibrate on the held-out sequences again, in index order, each module in
        registration order, into statistics of their fold alone; modules that shared an
        input share it again."""
        sequences = {}
        for module in self.module_names:
            for row, sequence in held.get(module, []):
                sequences.setdefault(id(sequence), (row, sequence, []))[2].append(module)
        folds: dict[int, CalibrationStatistics] = {}
        held_now = self.host.swap_statistics(CalibrationStatistics())
        try:
            for row, sequence, modules in sorted(sequences.values(), key=lambda item: item[0]):
                fold = folds.setdefault(self.fold_of(row), CalibrationStatistics())
                self.host.swap_statistics(fold)
                batch = sequence.unsqueeze(0).to(get_execution_device(modules[0]))
                for module in modules:
                    self.host.calibrate_held_out(module, batch, row)
        finally:
            self.host.swap_statistics(held_now)
        for fold in range(self.holdout_every - self.gamma_folds, self.holdout_every):
            folds.setdefault(fold, CalibrationStatistics())  # none on this rank
        return folds

    def _selection_groups(self, held: dict[torch.nn.Module, list], calibrated: set) -> list[tuple]:
        """``(group, gated MLP or None)`` per group of difference modules calibrated in
        this layer that shares one gamma: a gated MLP's gate and up projections together,
        any other module alone."""
        groups, done = [], set()
        for module in self.module_names:
            if module in done or module not in calibrated:
                continue  # grouped already, or not in this layer
            if not self.host.is_difference_module(module):
                continue
            mlp = self._gated_mlps.get(module)
            group = [module]
            if mlp is not None:
                group = [
                    m for m in (mlp.gate_proj, mlp.up_proj) if self.host.is_difference_module(m)
                ]
            done.update(group)
            if all_reduce_sum(len(held.get(group[0], []))) == 0:
                raise ValueError(
                    f"gamma 'auto' holds out every {self.holdout_every}th calibration "
                    f"sequence, and {self.module_names[module]} saw none: calibrate on at "
                    f"least {self.holdout_every} sequences (or lower holdout_every)"
                )
            groups.append((group, mlp))
        return groups

    def _fold_errors(self, group, mlp, held, fold: int) -> torch.Tensor:
        """``[candidates, sequences]``: each candidate's error on this rank's held-out
        sequences of ``fold``, pruned with the statistics held now (the other folds')."""
        inputs = [
            held_out_tokens(sequence, row, self.holdout_every, self.gamma_folds)
            for row, sequence in held.get(group[0], [])
            if self.fold_of(row) == fold
        ]
        pruned = self.host.candidate_weights(group, self.candidates)
        return self._held_out_errors(group, mlp, inputs, pruned)

    def _choose(self, group: list, fold_errors: list[torch.Tensor]) -> float:
        """Choose, record and return ``group``'s gamma from every fold's errors."""
        best, errors, standard_errors, fold_choices = select_gamma(
            self.candidates, fold_errors, self.gamma_evidence, all_reduce_sum
        )
        for module in group:
            self.chosen[module] = best
            self.record[self.module_names[module]] = {
                "gamma": best,
                "chosen_gamma": best,
                "held_out_error": {str(gamma): error for gamma, error in errors.items()},
                "difference_se": {str(g): se for g, se in standard_errors.items()},
                "fold_gammas": fold_choices,
            }
        logger.info(
            f"{', '.join(self.module_names[m] for m in group)}: gamma {best} "
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
                return output_errors(
                    inputs, module.weight, [c[module] for c in candidates], self.gamma_criterion
                )
            gate, up = mlp.gate_proj, mlp.up_proj
            return gated_mlp_errors(
                inputs,
                gate.weight,
                up.weight,
                mlp.down_proj.weight,
                mlp.act_fn,
                [(c.get(gate, gate.weight), c.get(up, up.weight)) for c in candidates],
                self.gamma_criterion,
            )
