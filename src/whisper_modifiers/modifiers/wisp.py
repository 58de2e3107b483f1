"""Wisp and Wisp+: no-update pruning over a channel statistic (their RIA composites are
``ria.py``'s)."""

from __future__ import annotations

from typing import Literal

import torch
from compressed_tensors.utils import align_module_device, update_offload_parameter
from llmcompressor.modifiers.pruning.wanda import WandaPruningModifier
from llmcompressor.utils.metric_logging import CompressionLogger
from loguru import logger
from pydantic import Field, model_validator

from whisper_modifiers.modifiers.base import DifferencePruningBase
from whisper_modifiers.modifiers.calibration_statistics import ModuleStatistics
from whisper_modifiers.modifiers.distributed import solve_on_owners
from whisper_modifiers.selection import WISP_GAMMA_CANDIDATES
from whisper_modifiers.solvers import prune_by_score, wanda_scores
from whisper_modifiers.statistics import (
    centered,
    mapping_difficulty,
    neuronwise_difference,
    regularized_difference_norms,
)

__all__ = ["WispModifier", "WispPlusModifier"]


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

    def calibrate_module(self, module, args, _output):
        x, statistics = args[0], self._statistics
        if not self.is_difference_module(module) or self.gamma == 1:
            return statistics.add_channel_norms(module, x)
        if self.pairing == "centered":  # ||X_c,j||^2 = ||X_j||^2 - s x_bar_j^2
            statistics.add_channel_norms(module, x)
            return statistics.add_centering(module, self._pairs.sequence_means(module, x), False)
        self._add_plain_norms(module, x)
        statistics.add_channel_norms(module, self._pairs.sequence_differences(module, x))

    def _add_plain_norms(self, module, x: torch.Tensor):
        """Wanda's ``||X_j||^2`` beside the difference statistic, for a mixture
        (``gamma`` neither 0 nor 1), and always for an MoE expert (its statistic if no
        sequence sends it 2 tokens: ``_fall_back_without_pairs``)."""
        if self.gamma != 0 or self._pairs.routing.is_expert(module):
            self._statistics.add_plain_norms(module, x)

    def scores(self, weight: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
        """The saliency over a channel statistic (``||X_j||``, ``||dX_j||`` or ``a_ij``)."""
        return wanda_scores(weight, channel_scale)

    def compress_modules(self):
        """Reduce the statistics across ranks (torchrun) and choose gamma (``auto``),
        then prune each module on one rank (``distributed``); in one process, just
        ``solve``."""
        self.reduce_and_select()
        self._fall_back_without_pairs()
        modules = [m for m in self._module_names if m in self._statistics]
        solve_on_owners(self._statistics, modules, self.solve)

    def _fall_back_without_pairs(self):
        """An MoE expert that no calibration sequence sent 2 tokens has no pair: it is
        pruned with Wanda's statistic, which it always keeps, and a warning."""
        for module in self._statistics:
            statistics = self._statistics[module]
            if self._pairs.routing.is_expert(module) and not self._has_pairs(statistics):
                self._pairs.warn_without_pairs(module, "Wanda's statistic")
                statistics.fall_back_to_plain()

    def _has_pairs(self, statistics: ModuleStatistics) -> bool:
        return statistics.channel_norms.held

    def channel_statistic(self, module, gamma: float) -> torch.Tensor:
        """The statistic under ``|W_ij|`` in the saliency, from the statistics held now:
        ``||X_j||`` (Wanda), ``||dX_j||`` or ``||X_c,j||`` (Wisp), or their mixture at
        ``gamma`` (``regularized_difference_norms``)."""
        statistics = self._statistics[module]
        norms = statistics.channel_norms.total
        if statistics.centering_norms.held:
            plain, difference = norms, centered(norms, statistics.centering_norms.total)
        elif statistics.plain_norms.held:
            plain, difference = statistics.plain_norms.total, norms
        else:  # Wanda's module, or gamma 0 or 1: one statistic
            return norms.sqrt()
        if gamma == 0:
            return difference.sqrt()
        return regularized_difference_norms(plain.to(norms.device), difference, gamma).sqrt()

    def solve(self):
        """Prune every module left with statistics."""
        for module in self._statistics:
            statistic = self.channel_statistic(module, self.gamma_of(module))
            count = self._statistics[module].channel_norms.count
            self._statistics.drop(module)
            self._prune(module, statistic, count)

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
        x, statistics = args[0], self._statistics
        if not self.is_difference_module(module) or self.gamma == 1:
            return statistics.add_channel_norms(module, x)
        differences = self._pairs.sequence_differences(module, x)
        self._add_plain_norms(module, x)
        held = statistics.of(module)  # solved even if no pair counts (an error then)
        specializing = self.specialized_fraction < 1
        if specializing:
            statistics.add_channel_norms(module, differences)
        with align_module_device(module):
            for sequence in differences:
                statistic = neuronwise_difference(module.weight, sequence, self.pair_fraction)
                held.neuronwise.add(statistic)
                if specializing:
                    held.difficulty.add(mapping_difficulty(module.weight, sequence))

    def channel_statistic(self, module, gamma: float) -> torch.Tensor:
        """Wisp+'s ``a_ij`` (with Wisp's rows for the easier neurons when
        ``specialized_fraction < 1``), or its mixture with ``||X_j||^2`` at ``gamma``:
        ``sqrt(gamma ||X_j||^2 + (1 - gamma) (mu / mu_a) a_ij^2)``
        (``regularized_difference_norms``); other modules as Wisp's."""
        statistics = self._statistics[module]
        neuronwise = statistics.neuronwise
        if not neuronwise.held or not neuronwise.total.any():  # no pair, or none of length
            if self._draws_pairs(module):
                raise ValueError(
                    f"{self._module_names[module]}: every sampled pair of every calibration "
                    "sequence had zero input distance, so Wisp+ has no pair to select"
                )
            return super().channel_statistic(module, gamma)
        statistic = neuronwise.total / neuronwise.count
        if self.specialized_fraction < 1:
            statistic = self._specialize(statistics, statistic)
        if gamma == 0 or not statistics.plain_norms.held:
            return statistic
        plain = statistics.plain_norms.total.to(statistic.device)
        return regularized_difference_norms(plain, statistic.square(), gamma).sqrt()

    def _draws_pairs(self, module) -> bool:
        """Whether ``module`` gets Wisp+'s statistic (an MoE expert without pairs falls
        back to Wanda's)."""
        routed_expert = self._pairs.routing.is_expert(module)
        return self.is_difference_module(module) and self.gamma != 1 and not routed_expert

    def solve(self):
        for module in self._statistics:
            statistics = self._statistics[module]
            statistic = self.channel_statistic(module, self.gamma_of(module))
            held = statistics.neuronwise if statistics.neuronwise.held else statistics.channel_norms
            self._statistics.drop(module)
            self._prune(module, statistic, held.count)

    def _has_pairs(self, statistics: ModuleStatistics) -> bool:
        return statistics.neuronwise.held

    def _specialize(self, statistics: ModuleStatistics, neuronwise: torch.Tensor) -> torch.Tensor:
        """Wisp+'s rows for the most difficult neurons, Wisp's for the rest."""
        difficulty = statistics.difficulty.total
        wisp = statistics.channel_norms.total.sqrt().to(neuronwise.device)
        statistic = wisp.expand_as(neuronwise).clone()
        specialized = difficulty.topk(round(self.specialized_fraction * len(difficulty))).indices
        statistic[specialized] = neuronwise[specialized]
        return statistic
