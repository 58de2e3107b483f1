"""Routing shared by the difference-informed modifiers.

``DifferencePruningBase`` adds to llmcompressor's ``SparsityModifierBase``:

* ``difference_targets`` -- which of the targeted Linear modules get the difference
  statistic (default: the MLP gate and up projections, paper Section 3); every other
  targeted module is pruned by the parent's standard method inside the same modifier;
* seeded pairwise differences formed within each calibration sequence;
* ``gamma`` and its per-module choice ``gamma: auto`` (``selection``): held-out
  sequences, candidate solves, and the record of the choice;
* input validation before any calibration work;
* module names without llmcompressor 0.14's trailing dot, so that ``ignore: ["lm_head"]``
  and ``$``-anchored regexes match what users expect.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from typing import Annotated, ClassVar, Literal

import torch
from compressed_tensors.utils import (
    align_module_device,
    get_execution_device,
    match_named_modules,
    match_targets,
)
from llmcompressor.core import Event, State
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_base import (
    PRUNABLE_LAYER_TYPES,
    SparsityModifierBase,
)
from loguru import logger
from pydantic import Field, PrivateAttr, model_validator

from whisper_modifiers.modifiers.distributed import (
    all_reduce_sum,
    reduce_statistics,
    sequence_offset,
    statistic_names,
)
from whisper_modifiers.modifiers.sequence_sums import SequenceSumCalibration
from whisper_modifiers.modifiers.validation import (
    SparsityValidation,
    check_finite_activations,
    check_structure_divides,
    parse_mask_structure,
)
from whisper_modifiers.selection import (
    gated_mlp_errors,
    is_held_out,
    output_errors,
    select_gamma,
)
from whisper_modifiers.statistics import (
    nearest_neighbour_differences,
    pair_permutations,
    pairwise_differences,
    scaled_sequence_means,
)

__all__ = ["DEFAULT_DIFFERENCE_TARGETS", "DifferencePruningBase", "Gamma"]

DEFAULT_DIFFERENCE_TARGETS = [r"re:.*mlp\.(gate|up)_proj$"]
GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")

Gamma = Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"]
"""A mixing weight in [0, 1], or ``"auto"``: chosen per module (``selection``)."""


class DifferencePruningBase(SparsityValidation, SequenceSumCalibration, SparsityModifierBase):
    """Fields and routing common to Wisp, Wisp+ and Whisper (see those classes).

    :param difference_targets: module-name patterns (``re:`` prefix for a regex, as in
        llmcompressor's ``targets``/``ignore``) that get the difference statistic; ``[]``
        turns every module into the standard method.  Each pattern must match at least
        one targeted module.
    :param seed: seed of the pair permutations; the same seed gives the same masks.
    :param num_permutations: independent permutations per calibration sequence (the
        paper's ``N = k s`` pairs, Appendix "Sampling approach details"); 1 suffices.
    :param pairing: ``"random"`` (seeded permutations, the paper's default),
        ``"nearest"`` (each token paired with its nearest other token of the sequence,
        appendix "Sampling approach details") or ``"centered"`` (the deterministic
        second-moment form of random pairing, appendix "Centering": ``||X_c,j||`` for
        Wisp, ``H_c = X_c X_c^T`` for Whisper; not defined for Wisp+).
    :param ignore: as llmcompressor's, but defaults to ``["lm_head"]`` (the paper does
        not prune the LM head, and tied embeddings would be pruned with it).
    :param gamma: weight of the standard statistic in the mixture with the difference
        statistic (see each method), or ``"auto"``: chosen per difference module from
        ``gamma_candidates`` by the held-out error of ``selection`` (a gated MLP's gate
        and up projections share one choice); the choices are in ``gamma_selection()``
        and in whisper-prune's ``sparsity_record.json``.
    :param gamma_candidates: the values ``"auto"`` chooses from (default: the method's
        ``GAMMA_CANDIDATES``); only with ``gamma: auto``.
    :param holdout_every: with ``gamma: auto``, every ``holdout_every``-th calibration
        sequence (global index ``i`` with ``i % holdout_every == holdout_every - 1``) is
        held out to measure the candidates, then joins the statistics for the final solve.
    :param gamma_evidence: with ``gamma: auto``, how many standard errors of the paired
        per-held-out-sequence difference a candidate's mean error must beat the largest
        candidate's (the baseline's, gamma 1) by to be chosen over it; ``0`` picks the
        least error (``selection.choose_gamma``).
    :param gamma_criterion: with ``gamma: auto``, a held-out sequence's error:
        ``"relative"`` (each token's output error against its dense output's squared
        norm, averaged over tokens) or ``"absolute"`` (squared errors summed over tokens);
        ``selection.sequence_error``.
    """

    GAMMA_CANDIDATES: ClassVar[tuple[float, ...]] = ()

    difference_targets: list[str] = Field(default_factory=lambda: list(DEFAULT_DIFFERENCE_TARGETS))
    seed: int = Field(default=0, ge=0)
    num_permutations: int = Field(default=1, ge=1)
    pairing: Literal["random", "nearest", "centered"] = "random"
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    gamma: Gamma = 0.0
    gamma_candidates: list[Annotated[float, Field(ge=0.0, le=1.0)]] | None = None
    holdout_every: int = Field(default=4, ge=2)
    gamma_evidence: float = Field(default=2.0, ge=0.0)
    gamma_criterion: Literal["relative", "absolute"] = "relative"

    _difference_modules: set[torch.nn.Module] = PrivateAttr(default_factory=set)
    _sequences_seen: dict[torch.nn.Module, int] = PrivateAttr(default_factory=dict)
    _pair_sources: dict[torch.nn.Module, torch.nn.Module] = PrivateAttr(default_factory=dict)
    _last_input: tuple | None = PrivateAttr(default=None)
    _last_differences: torch.Tensor | None = PrivateAttr(default=None)
    _centering: dict[torch.nn.Module, tuple[torch.Tensor, int]] = PrivateAttr(default_factory=dict)
    _rows: list[int] = PrivateAttr(default_factory=list)
    _calibrated: set[torch.nn.Module] = PrivateAttr(default_factory=set)
    _split: tuple | None = PrivateAttr(default=None)
    _held_inputs: dict[torch.nn.Module, list] = PrivateAttr(default_factory=dict)
    _gated_mlps: dict[torch.nn.Module, torch.nn.Module] = PrivateAttr(default_factory=dict)
    _chosen_gammas: dict[torch.nn.Module, float] = PrivateAttr(default_factory=dict)
    _gamma_record: dict[str, dict] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _validate_pairing(self):
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

    def on_initialize(self, state: State, **kwargs) -> bool:
        from whisper_modifiers.modifiers.masked_gptq import check_mask_kept

        check_mask_kept()  # this session's recipe
        self._gamma_record = dict()
        return super().on_initialize(state, **kwargs)

    # -- routing ---------------------------------------------------------------------

    def pruned_modules(self, target_layers: dict[str, torch.nn.Module]) -> list[tuple]:
        """``(name, module, sparsity)`` of every module this modifier prunes inside
        ``target_layers`` (llmcompressor's selection, with clean names)."""
        modules = []
        for index, (layer_name, layer) in enumerate(target_layers.items()):
            sparsity = self.sparsity[index] if isinstance(self.sparsity, list) else self.sparsity
            for name, module in match_named_modules(layer, PRUNABLE_LAYER_TYPES):
                name = f"{layer_name}.{name}" if name else layer_name
                if isinstance(module, torch.nn.Embedding) or match_targets(
                    name, module, self.ignore
                ):
                    continue
                modules.append((name, module, sparsity))
        n, m = parse_mask_structure(self.mask_structure)
        check_structure_divides([(name, module) for name, module, _ in modules], n, m)
        return modules

    def check_difference_targets(self, model: torch.nn.Module) -> list[str]:
        """Resolve ``difference_targets`` against ``model`` (a meta-device model will do:
        only names and types are read) before any calibration; raises the same errors as
        calibration would. Returns the names of the difference modules."""
        modules = self.pruned_modules(dict(match_named_modules(model, self.targets)))
        selected = self._select_difference_modules(modules)
        return [name for name, module, _ in modules if module in selected]

    def on_calibration_start(self, state: State, event: Event, **kwargs):
        """Register the calibration hooks (llmcompressor's loop, with clean names)."""
        modules = self.pruned_modules(self._target_layers)
        self._difference_modules = self._select_difference_modules(modules)
        for name, module, sparsity in modules:
            if name.endswith("lm_head"):
                logger.warning(
                    f"{type(self).__name__} will prune {name}; add it to `ignore` to keep "
                    "the LM head dense (the paper does not prune it)"
                )
            self._module_names[module] = name
            self._module_sparsities[module] = sparsity
            self.register_hook(module, self._calibrate_finite, "forward")
        for name, module, _ in modules:  # the gated MLP each gate/up projection is part of
            parent = state.model.get_submodule(name.rpartition(".")[0])
            if all(hasattr(parent, part) for part in GATED_MLP_PARTS) and module in (
                parent.gate_proj,
                parent.up_proj,
            ):
                self._gated_mlps[module] = parent
        logger.info(
            f"{type(self).__name__}: difference statistic on "
            f"{len(self._difference_modules)} of {len(modules)} modules"
        )

    def _calibrate_finite(self, module, args, output):
        """``calibrate_module``, after refusing NaN or inf inputs (every module, routed
        to the difference statistic or to the standard method). With ``gamma: auto`` the
        held-out sequences of a difference module are stored instead (``selection``)."""
        x = args[0]
        check_finite_activations(self._module_names[module], x)
        first = self._sequences_seen.get(module, sequence_offset())  # global index
        rows = list(range(first, first + (x.shape[0] if x.dim() == 3 else 1)))
        self._sequences_seen[module] = rows[-1] + 1
        self._calibrated.add(module)
        if self.gamma != "auto" or not self.is_difference_module(module):
            self._rows = rows
            return self.calibrate_module(module, args, output)
        fit_rows, fit, held = self._split_held_out(x, rows)
        self._held_inputs.setdefault(module, []).extend(held)
        if fit_rows:
            self._rows = fit_rows
            self.calibrate_module(module, (fit,), output)

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

    def _select_difference_modules(self, modules) -> set[torch.nn.Module]:
        selected = set()
        for pattern in self.difference_targets:
            matched = [(n, m) for n, m, _ in modules if match_targets(n, m, [pattern])]
            if not matched:
                examples = ", ".join(n for n, _, _ in modules[:8]) or "(none)"
                raise ValueError(
                    f"difference_targets pattern {pattern!r} matches none of the "
                    f"{len(modules)} modules this modifier prunes; some of them: "
                    f"{examples}. Use 're:' for a regex, e.g. "
                    f"{DEFAULT_DIFFERENCE_TARGETS[0]!r}"
                )
            for name, module in matched:
                if not isinstance(module, torch.nn.Linear):
                    raise ValueError(
                        f"difference_targets pattern {pattern!r} matches {name}, a "
                        f"{type(module).__name__}; the difference statistics are defined "
                        "for torch.nn.Linear only"
                    )
                selected.add(module)
        return selected

    def is_difference_module(self, module: torch.nn.Module) -> bool:
        return module in self._difference_modules

    def sequence_differences(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Pairwise differences of every sequence (batch row) of a hook's input.

        Each row gets its own permutations, seeded by ``(seed, module name, global index
        of the sequence)``, so pairs do not depend on batch size, module order or the
        number of ranks (``distributed.sequence_offset``).  Modules that
        receive the very same input tensor in one forward pass (a gate and an up
        projection) share the pairs of the first of them: the differences are computed
        once, and ``pair_source`` tells which module they were drawn for.

        :return: ``[b, num_permutations * seq_len, m]`` float32.
        """
        if self.input_source(module, x) is module:
            self._last_differences = self._draw_differences(module, x)
        return self._last_differences

    def input_source(self, module: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
        """The first module that received this very input tensor in this forward pass
        (``module`` itself unless its input is shared, as gate and up share theirs); the
        statistics of the input are computed once, for that module. Recorded as
        ``pair_source``."""
        cached = self._last_input
        if cached is not None and cached[0]() is x and cached[1] == x._version:
            source = cached[2]
        else:
            source = module
            self._last_input = (weakref.ref(x), x._version, module)
        if self._pair_sources.setdefault(module, source) is not source:
            raise RuntimeError(
                f"{self._module_names[module]} shared its input with "
                f"{self._module_names[source]} in one batch but not in another"
            )
        return source

    def pair_source(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module whose input statistics ``module`` uses (itself unless its input is
        shared)."""
        return self._pair_sources[module]

    def check_input(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A hook's input as ``[b, seq_len, m]``, after the checks every pairing needs
        (finiteness is checked for every module by the hook, ``_calibrate_finite``)."""
        name = self._module_names[module]
        if x.dim() == 2:
            x = x.unsqueeze(0)
        if x.shape[1] < 2:
            raise ValueError(
                f"{name} received a calibration sequence of {x.shape[1]} token(s); "
                f"{type(self).__name__} forms pairs within each sequence and needs at "
                "least 2 tokens per sequence (raise max_seq_length or drop short samples)"
            )
        return x

    def _draw_differences(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = self.check_input(module, x)
        if self.pairing == "nearest":
            return torch.stack([nearest_neighbour_differences(sequence) for sequence in x])
        if self.pairing != "random":
            raise RuntimeError(f"pairing {self.pairing!r} forms no explicit pairs")
        module_id = zlib.crc32(self._module_names[module].encode())
        return torch.stack(
            [
                pairwise_differences(
                    sequence,
                    pair_permutations(
                        x.shape[1], self.num_permutations, (self.seed, module_id, row)
                    ),
                )
                for row, sequence in zip(self._rows, x, strict=True)
            ]
        )

    def add_centering(self, module: torch.nn.Module, x: torch.Tensor, add):
        """Add ``s x_bar x_bar^T`` (or its diagonal) of each sequence with ``add``
        (``add_sequence_grams`` or ``add_sequence_channel_norms``): with the uncentered
        statistic the parent keeps, it gives the centered one by subtraction. Costs one
        mean per sequence."""
        means = scaled_sequence_means(self.check_input(module, x))
        total, count = self._centering.get(module, (None, 0))
        self._centering[module] = (add(total, means), count + means.shape[0])

    def centered(self, module: torch.nn.Module, uncentered: torch.Tensor) -> torch.Tensor:
        """``uncentered - s x_bar x_bar^T`` (diagonal entries clamped at 0)."""
        correction, _ = self._centering[module]
        centered = uncentered - correction.to(uncentered.device)
        if centered.dim() == 1:
            return centered.clamp_min(0)
        centered.diagonal().clamp_(min=0)
        return centered

    # -- gamma: auto -----------------------------------------------------------------

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
        self._last_input = self._last_differences = None  # release the layer's last batch
        self._split = None
        super().on_sequential_epoch_end(state, event, **kwargs)
        self._calibrated = set()

    def _reset_routing(self):
        self._difference_modules = set()
        self._sequences_seen = dict()
        self._pair_sources = dict()
        self._last_input = None
        self._last_differences = None
        self._centering = dict()
        self._rows = []
        self._calibrated = set()
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
