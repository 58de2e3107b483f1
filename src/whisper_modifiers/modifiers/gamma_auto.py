"""``gamma: auto``: gamma chosen per difference module on held-out calibration sequences.

The maths is ``selection.py``'s (the block output error of each candidate, the evidence
rule); this mixin is its calibration glue for ``DifferencePruningBase``:

* every ``holdout_every``-th calibration sequence of a difference module is held out
  (``hold_out``) instead of calibrating it;
* after the layer's forward passes, ``reduce_and_select`` copies the statistics of the
  other sequences, replays the held-out ones into the full statistics (so the final solve
  sees every sequence), and chooses each group's gamma from the copy: a gated MLP's gate
  and up projections together, by the error of the MLP block's output
  (``selection.select_gamma``);
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
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from whisper_modifiers.modifiers.distributed import (
    all_reduce_sum,
    reduce_statistics,
    statistic_names,
)
from whisper_modifiers.selection import (
    gated_mlp_errors,
    is_held_out,
    output_errors,
    select_gamma,
)

__all__ = ["GATED_MLP_PARTS", "Gamma", "GammaAuto"]

GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")

Gamma = Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"]
"""A mixing weight in [0, 1], or ``"auto"``: chosen per module (``selection``)."""


class GammaAuto(BaseModel):
    """The ``gamma`` fields of a difference modifier and ``gamma: auto``'s selection
    (the fields are documented on ``DifferencePruningBase``)."""

    GAMMA_CANDIDATES: ClassVar[tuple[float, ...]] = ()

    gamma: Gamma = 0.0
    gamma_candidates: list[Annotated[float, Field(ge=0.0, le=1.0)]] | None = None
    holdout_every: int = Field(default=4, ge=2)
    gamma_evidence: float = Field(default=2.0, ge=0.0)
    gamma_criterion: Literal["relative", "absolute"] = "relative"

    _split: tuple | None = PrivateAttr(default=None)
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
        """Keep the held-out sequences of a hook's input for the selection; returns the
        rows and activations left to calibrate on (``(rows, None)`` if none is left)."""
        fit_rows, fit, held = self._split_held_out(x, rows)
        self._held_inputs.setdefault(module, []).extend(held)
        return fit_rows, fit

    def _split_held_out(self, x: torch.Tensor, rows: list[int]):
        """``(fit rows, their activations, [(index, held-out sequence)]) `` of a hook's
        input; computed once per input tensor, so modules sharing their input (gate and
        up) share the very tensors (``input_source``)."""
        cached = self._split
        if cached is not None and cached[0]() is x and cached[1] == x._version:
            return cached[2]
        sequences = x if x.dim() == 3 else x.unsqueeze(0)
        held = [b for b, row in enumerate(rows) if is_held_out(row, self.holdout_every)]
        fit = [b for b in range(len(rows)) if b not in held]
        split = (
            [rows[b] for b in fit],
            x if not held else sequences[fit] if fit else None,
            [(rows[b], sequences[b].detach().to("cpu", copy=True)) for b in held],
        )
        self._split = (weakref.ref(x), x._version, split)
        return split

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
        """Reduce the statistics across ranks (``distributed``). Under ``gamma: auto`` the
        held-out sequences are folded into them too, and each difference module's gamma
        is chosen with a copy taken before (the other sequences' statistics, reduced
        alike)."""
        if self.gamma != "auto" or not self._difference_modules:
            return reduce_statistics(self)
        selecting = self._difference_modules & self._calibrated
        fit = {name: _copy_statistics(getattr(self, name), selecting) for name in statistic_names()
               if getattr(self, name, None) is not None}  # fmt: skip
        held = self._held_inputs
        self._replay(held)
        reduce_statistics(self)
        everything = {name: getattr(self, name) for name in fit}
        for name, statistics in fit.items():
            setattr(self, name, statistics)
        try:
            reduce_statistics(self)
            self._select_gammas(held)
        finally:
            for name, statistics in everything.items():
                setattr(self, name, statistics)

    def _replay(self, held: dict[torch.nn.Module, list]):
        """Calibrate on the held-out sequences, in index order, each module in
        registration order; modules that shared an input share it again."""
        self._held_inputs = dict()
        sequences = {}
        for module in self._module_names:
            for row, sequence in held.get(module, []):
                sequences.setdefault(id(sequence), (row, sequence, []))[2].append(module)
        for row, sequence, modules in sorted(sequences.values(), key=lambda item: item[0]):
            batch = sequence.unsqueeze(0).to(get_execution_device(modules[0]))
            for module in modules:
                self._rows = [row]
                self.calibrate_module(module, (batch,), None)

    def _select_gammas(self, held: dict[torch.nn.Module, list]):
        """Choose gamma for each group of difference modules: a gated MLP's gate and up
        projections together, any other module alone."""
        done = set()
        for module in self._module_names:
            if module in done or module not in self._calibrated:
                continue  # solved already, or not in this layer
            if not self.is_difference_module(module):
                continue
            mlp = self._gated_mlps.get(module)
            group = [module]
            if mlp is not None:
                group = [m for m in (mlp.gate_proj, mlp.up_proj) if self.is_difference_module(m)]
            done.update(group)
            inputs = [sequence for _, sequence in held.get(group[0], [])]
            if all_reduce_sum(len(inputs)) == 0:
                raise ValueError(
                    f"gamma 'auto' holds out every {self.holdout_every}th calibration "
                    f"sequence, and {self._module_names[module]} saw none: calibrate on at "
                    f"least {self.holdout_every} sequences (or lower holdout_every)"
                )
            best, errors, standard_errors = select_gamma(
                self.candidate_gammas(),
                lambda gammas, group=group: self.candidate_weights(group, gammas),
                lambda pruned, group=group, mlp=mlp, inputs=inputs: self._held_out_errors(
                    group, mlp, inputs, pruned
                ),
                self.gamma_evidence,
                all_reduce_sum,
            )
            for m in group:
                self._chosen_gammas[m] = best
                self._gamma_record[self._module_names[m]] = {
                    "gamma": best,
                    "held_out_error": {str(gamma): error for gamma, error in errors.items()},
                    "difference_se": {str(g): se for g, se in standard_errors.items()},
                }
            logger.info(
                f"{', '.join(self._module_names[m] for m in group)}: gamma {best} "
                f"(mean held-out error {errors[best]:.4g}; candidates {errors}, standard "
                f"errors of their difference to {max(errors)} {standard_errors})"
            )

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
        self._split = None  # release the layer's last batch
        super().on_sequential_epoch_end(state, event, **kwargs)

    def _reset_gamma_auto(self):
        self._split = None
        self._held_inputs = dict()
        self._gated_mlps = dict()
        self._chosen_gammas = dict()


def _copy_statistics(statistics: dict, modules: set) -> dict:
    """A copy of the entries of ``modules`` in a per-module statistic dict, sharing no
    tensor with it."""
    return {
        module: value.clone() if isinstance(value, torch.Tensor)
        else tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in value)
        if isinstance(value, tuple) else value
        for module, value in statistics.items() if module in modules
    }  # fmt: skip
