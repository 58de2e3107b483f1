"""Wisp, Wisp+ and their RIA composites: no-update pruning over a channel statistic."""

from __future__ import annotations

from typing import Literal

import torch
from compressed_tensors.utils import align_module_device, update_offload_parameter
from llmcompressor.core import State
from llmcompressor.modifiers.pruning.wanda import WandaPruningModifier
from llmcompressor.utils.metric_logging import CompressionLogger
from loguru import logger
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from whisper_modifiers.modifiers.base import DifferencePruningBase
from whisper_modifiers.modifiers.distributed import solve_on_owners
from whisper_modifiers.selection import WISP_GAMMA_CANDIDATES
from whisper_modifiers.solvers import prune_by_score, ria_scores, wanda_scores
from whisper_modifiers.statistics import (
    SUM_DTYPE,
    add_sequence_channel_norms,
    mapping_difficulty,
    neuronwise_difference,
    regularized_difference_norms,
)

__all__ = [
    "RIAModifier",
    "RIAWispModifier",
    "RIAWispPlusModifier",
    "WispModifier",
    "WispPlusModifier",
]


class WispModifier(DifferencePruningBase, WandaPruningModifier):
    """Wisp: Wanda's no-update pruning with ``S_ij = |W_ij| * ||dX_j||_2`` on the modules
    matched by ``difference_targets`` (paper Section 3.1), where ``dX = X - X_pi`` are
    pairwise differences sampled within each calibration sequence.  Every other targeted
    module is pruned by Wanda (``S_ij = |W_ij| * ||X_j||_2``).  Each output row is pruned
    to the same sparsity, as Wanda does.

    Sample yaml:

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        WispModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          # difference_targets: default, every gated MLP's gate and up (experts too)
          ignore: ["lm_head"]
          seed: 0
    ```

    Fields: those of ``WandaPruningModifier`` plus ``difference_targets``, ``seed``,
    ``num_permutations``, ``gamma_candidates`` and ``holdout_every`` (see
    ``DifferencePruningBase``), and
    :param comparison_group: ``"row"`` (Wanda: every output row to the same sparsity) or
        ``"layer"`` (one threshold for the whole matrix); N:M ignores it.
    :param gamma: the gamma-regularised Wisp, ``S_ij = |W_ij| sqrt(gamma ||X_j||^2 +
        (1 - gamma) (mu / mu_Delta) ||dX_j||^2)``: the diagonal of Whisper's ``H~``
        (``statistics.regularized_difference_norms``).  0 (default) is Wisp, 1 is
        Wanda, both exactly; ``"auto"`` chooses per gate/up pair from 0, 0.1, 0.3 and 1 by
        the MLP block's error on held-out calibration sequences (``selection``).
    """

    GAMMA_CANDIDATES = WISP_GAMMA_CANDIDATES
    comparison_group: Literal["row", "layer"] = "row"

    _plain_norms: dict[torch.nn.Module, torch.Tensor] = PrivateAttr(default_factory=dict)
    _plain_counts: dict[torch.nn.Module, int] = PrivateAttr(default_factory=dict)

    def calibrate_module(self, module, args, _output):
        if not self.is_difference_module(module) or self.gamma == 1:
            return self.add_row_scalars(module, args[0])
        if self.pairing == "centered":  # ||X_c,j||^2 = ||X_j||^2 - s x_bar_j^2
            self.add_row_scalars(module, args[0])
            return self.add_centering(module, args[0], add_sequence_channel_norms)
        self._accumulate_plain_norms(module, args[0])
        self._accumulate_difference_norms(module, self.sequence_differences(module, args[0]))

    def _accumulate_plain_norms(self, module, x: torch.Tensor):
        """Wanda's ``||X_j||^2`` beside the difference statistic, for a mixture
        (``gamma`` neither 0 nor 1), and always for an MoE expert (its statistic if no
        sequence sends it 2 tokens: ``_fall_back_without_pairs``)."""
        if self.gamma == 0 and not self._routing.is_expert(module):
            return
        self.add_sequences("_plain_norms", "_plain_counts", module, x, add_sequence_channel_norms)

    def _accumulate_difference_norms(self, module, differences: torch.Tensor):
        self.add_row_scalars(module, differences)

    def scores(self, weight: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
        """The saliency over a channel statistic (``||X_j||``, ``||dX_j||`` or ``a_ij``)."""
        return wanda_scores(weight, channel_scale)

    def compress_modules(self):
        """Reduce the statistics across ranks (torchrun) and choose gamma (``auto``),
        then prune each module on one rank (``distributed``); in one process, just
        ``solve``."""
        self.reduce_and_select()
        self._fall_back_without_pairs()
        calibrated = set(self._num_samples) | set(getattr(self, "_neuronwise_counts", {}))
        modules = [m for m in self._module_names if m in calibrated]
        solve_on_owners(self, modules, self.solve)

    def _fall_back_without_pairs(self):
        """An MoE expert that no calibration sequence sent 2 tokens has no pair: it is
        pruned with Wanda's statistic, which it always keeps, and a warning."""
        for module in [m for m in self._plain_norms if self._routing.is_expert(m)]:
            if self._has_pairs(module):
                continue
            self.warn_without_pairs(module, "Wanda's statistic")
            self._drop_difference_statistics(module)
            self._row_scalars[module] = self._plain_norms.pop(module)
            self._num_samples[module] = self._plain_counts.pop(module)

    def _has_pairs(self, module) -> bool:
        return module in self._row_scalars

    def _drop_difference_statistics(self, module):
        pass  # Wisp's are in _row_scalars, absent here

    def channel_statistic(self, module, gamma: float) -> torch.Tensor:
        """The statistic under ``|W_ij|`` in the saliency, from the statistics held now:
        ``||X_j||`` (Wanda), ``||dX_j||`` or ``||X_c,j||`` (Wisp), or their mixture at
        ``gamma`` (``regularized_difference_norms``)."""
        norms = self._row_scalars[module]
        if module in self._centering:
            plain, difference = norms, self.centered(module, norms)
        elif module in self._plain_norms:
            plain, difference = self._plain_norms[module], norms
        else:  # Wanda's module, or gamma 0 or 1: one statistic
            return norms.sqrt()
        if gamma == 0:
            return difference.sqrt()
        return regularized_difference_norms(plain.to(norms.device), difference, gamma).sqrt()

    def solve(self):
        """Prune every module left with statistics."""
        for module in list(self._num_samples):
            count = self._num_samples[module]
            statistic = self.channel_statistic(module, self.gamma_of(module))
            self._drop_statistics(module)
            self._prune(module, statistic, count)

    def _drop_statistics(self, module):
        for statistics in (self._num_samples, self._row_scalars, self._plain_norms,
                           self._plain_counts, self._centering):  # fmt: skip
            statistics.pop(module, None)

    def candidate_weight(self, module, gamma: float) -> torch.Tensor:
        """The pruned weight at ``gamma`` (not written)."""
        with torch.no_grad(), align_module_device(module):
            return self._pruned(module, self.channel_statistic(module, gamma))

    def _pruned(self, module, statistic: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        return prune_by_score(
            weight,
            self.scores(weight, statistic.to(weight.device)),
            self._module_sparsities[module],
            self._prune_n,
            self._prune_m,
            self.comparison_group,
        )

    def _prune(self, module, statistic: torch.Tensor, count: int):
        name = self._module_names[module]
        logger.info(f"Sparsifying {name} using {count} samples")
        with torch.no_grad(), align_module_device(module), CompressionLogger(module):
            pruned = self._pruned(module, statistic)
        update_offload_parameter(module, "weight", pruned)

    def on_finalize(self, state: State, **kwargs) -> bool:
        self._reset_routing()
        self._plain_norms = dict()
        self._plain_counts = dict()
        return super().on_finalize(state, **kwargs)


class WispPlusModifier(WispModifier):
    """Wisp+: Wanda's no-update pruning with the neuronwise difference statistic
    ``S_ij = |W_ij| * a_ij``, ``a_ij`` = mean of ``|dX_jl|`` over the ``K`` pairs that
    neuron ``i`` separates most per unit input distance (paper Section 3.2), on the
    modules matched by ``difference_targets``; Wanda everywhere else.  ``a`` is computed
    per calibration sequence with the dense layer weights and averaged over sequences.

    Sample yaml:

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        WispPlusModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          pair_fraction: 0.005
          ignore: ["lm_head"]
    ```

    :param pair_fraction: ``K / s``, the fraction of a sequence's sampled pairs each
        neuron keeps (``K = max(1, round(pair_fraction * s))``); 0.005 in the paper.
    :param specialized_fraction: the fraction of each layer's neurons, highest mapping
        difficulty first, that get the neuronwise statistic; the others get Wisp's
        ``||dX_j||_2`` (appendix "From Wisp to Wisp+"; 1.0 is Wisp+, 0.0 is Wisp).
    """

    pair_fraction: float = Field(default=0.005, gt=0.0, le=1.0)
    specialized_fraction: float = Field(default=1.0, ge=0.0, le=1.0)

    _neuronwise_sums: dict[torch.nn.Module, torch.Tensor] = PrivateAttr(default_factory=dict)
    _neuronwise_counts: dict[torch.nn.Module, int] = PrivateAttr(default_factory=dict)
    _difficulty_sums: dict[torch.nn.Module, torch.Tensor] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _validate_wisp_plus(self):
        if self.pairing == "centered":
            raise ValueError(
                "pairing 'centered' is not defined for Wisp+: its neuron-specific pair "
                "selection needs explicit pairs (use 'random' or 'nearest')"
            )
        if self.specialized_fraction < 1 and self.comparison_group == "layer":
            raise ValueError(
                "specialized_fraction < 1 mixes two statistics of different scales across "
                "rows; it needs comparison_group 'row'"
            )
        return self

    def calibrate_module(self, module, args, _output):
        if not self.is_difference_module(module) or self.gamma == 1:
            return self.add_row_scalars(module, args[0])
        differences = self.sequence_differences(module, args[0])
        self._accumulate_plain_norms(module, args[0])
        self._neuronwise_counts.setdefault(module, 0)
        specializing = self.specialized_fraction < 1
        if specializing:
            self._accumulate_difference_norms(module, differences)
        with align_module_device(module):
            for sequence in differences:
                statistic = neuronwise_difference(module.weight, sequence, self.pair_fraction)
                if statistic is None:
                    continue
                _add(self._neuronwise_sums, module, statistic)
                if specializing:
                    _add(self._difficulty_sums, module, mapping_difficulty(module.weight, sequence))
                self._neuronwise_counts[module] += 1

    def channel_statistic(self, module, gamma: float) -> torch.Tensor:
        """Wisp+'s ``a_ij`` (with Wisp's rows for the easier neurons when
        ``specialized_fraction < 1``), or its mixture with ``||X_j||^2`` at ``gamma``:
        ``sqrt(gamma ||X_j||^2 + (1 - gamma) (mu / mu_a) a_ij^2)``
        (``regularized_difference_norms``); other modules as Wisp's."""
        if module not in self._neuronwise_counts:
            return super().channel_statistic(module, gamma)
        count = self._neuronwise_counts[module]
        if count == 0:
            raise ValueError(
                f"{self._module_names[module]}: every sampled pair of every calibration "
                "sequence had zero input distance, so Wisp+ has no pair to select"
            )
        statistic = self._neuronwise_sums[module] / count
        if self.specialized_fraction < 1:
            statistic = self._specialize(module, statistic)
        if gamma == 0 or module not in self._plain_norms:
            return statistic
        plain = self._plain_norms[module].to(statistic.device)
        return regularized_difference_norms(plain, statistic.square(), gamma).sqrt()

    def solve(self):
        for module in list(self._neuronwise_counts):
            statistic = self.channel_statistic(module, self.gamma_of(module))
            count = self._neuronwise_counts.pop(module)
            for statistics in (self._neuronwise_sums, self._difficulty_sums):
                statistics.pop(module, None)
            self._drop_statistics(module)
            self._prune(module, statistic, count)
        super().solve()

    def _has_pairs(self, module) -> bool:
        return self._neuronwise_counts.get(module, 0) > 0

    def _drop_difference_statistics(self, module):
        statistics = (self._neuronwise_counts, self._neuronwise_sums, self._difficulty_sums,
                      self._row_scalars, self._num_samples)  # fmt: skip
        for held in statistics:
            held.pop(module, None)

    def _specialize(self, module, neuronwise: torch.Tensor) -> torch.Tensor:
        """Wisp+'s rows for the most difficult neurons, Wisp's for the rest."""
        difficulty = self._difficulty_sums[module]
        wisp = self._row_scalars[module].sqrt().to(neuronwise.device)
        statistic = wisp.expand_as(neuronwise).clone()
        specialized = difficulty.topk(round(self.specialized_fraction * len(difficulty))).indices
        statistic[specialized] = neuronwise[specialized]
        return statistic

    def on_finalize(self, state: State, **kwargs) -> bool:
        if self._neuronwise_counts:
            raise ValueError(f"Failed to compress {len(self._neuronwise_counts)} modules")
        self._neuronwise_sums = dict()
        self._difficulty_sums = dict()
        return super().on_finalize(state, **kwargs)


def _add(sums: dict, key, value: torch.Tensor):
    """``sums[key] += value`` in float64 (a per-sequence statistic summed over sequences:
    exact, so the same in any order; ``distributed.reduce_statistics`` makes it float32)."""
    if key in sums:
        sums[key] += value
    else:
        sums[key] = value.to(SUM_DTYPE)


class RIAScoring(BaseModel):
    """RIA's saliency in place of Wanda's (mixin): ``(|W_ij| / ||W_:j||_1 + |W_ij| /
    ||W_i:||_1) * c^a``.

    :param ria_exponent: ``a``; 0.5 as in RIA and the paper.
    :param comparison_group: ``"layer"`` by default, as RIA's reference implementation
        and its published numbers use; ``"row"`` for Wanda's per-row groups.
    """

    ria_exponent: float = Field(default=0.5, gt=0.0)
    comparison_group: Literal["row", "layer"] = "layer"

    def scores(self, weight: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
        return ria_scores(weight, channel_scale, self.ria_exponent)


class RIAWispModifier(RIAScoring, WispModifier):
    """RIA-Wisp (paper Appendix "Composability"): RIA's saliency with ``||dX_j||_2`` on
    the ``difference_targets`` (gate/up), with ``||X_j||_2`` (plain RIA) elsewhere.

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        RIAWispModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          ignore: ["lm_head"]
    ```
    """


class RIAWispPlusModifier(RIAScoring, WispPlusModifier):
    """RIA-Wisp+: RIA's saliency with Wisp+'s ``a_ij`` on the ``difference_targets``,
    plain RIA elsewhere.

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        RIAWispPlusModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          ignore: ["lm_head"]
    ```
    """


class RIAModifier(RIAWispModifier):
    """RIA (Zhang et al. 2024) as a one-shot modifier: ``(|W_ij| / ||W_:j||_1 + |W_ij| /
    ||W_i:||_1) * ||X_j||_2^a`` on every targeted module (``difference_targets`` is empty).

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        RIAModifier:
          sparsity: 0.5
          ignore: ["lm_head"]
    ```
    """

    difference_targets: list[str] = Field(default_factory=list)
