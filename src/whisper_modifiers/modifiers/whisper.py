"""Whisper and ALPS-Whisper: reconstruction solvers over the regularised difference Hessian."""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch
from compressed_tensors.utils import (
    align_module_device,
    get_execution_device,
    update_offload_parameter,
)
from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_sparsify import sparsify_weight
from llmcompressor.utils.metric_logging import CompressionLogger
from loguru import logger
from pydantic import Field

from whisper_modifiers.alps import alps_prune
from whisper_modifiers.modifiers.base import DifferencePruningBase, Gamma
from whisper_modifiers.modifiers.calibration_statistics import CalibrationStatistics
from whisper_modifiers.modifiers.distributed import solve_on_owners
from whisper_modifiers.selection import WHISPER_GAMMA_CANDIDATES
from whisper_modifiers.solvers import sparsegpt_prune_batch
from whisper_modifiers.statistics import centered, regularized_difference_hessian

__all__ = ["ALPSModifier", "ALPSWhisperModifier", "WhisperModifier"]


class WhisperModifier(DifferencePruningBase, SparseGPTModifier):
    """Whisper: SparseGPT's block-wise OBS mask selection and weight update, with the
    Hessian of the modules matched by ``difference_targets`` replaced by
    ``H~ = gamma H + (1 - gamma) (mu / mu_Delta) dX dX^T`` (paper Section 3.3),
    ``dX`` being pairwise differences sampled within each calibration sequence.
    SparseGPT everywhere else; ``gamma: 1.0`` is SparseGPT exactly.

    Sample yaml:

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        WhisperModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          gamma: 0.01
          dampening_frac: 0.01
          block_size: 128
          ignore: ["lm_head"]
    ```

    :param gamma: weight of the standard Hessian ``H`` in ``H~``, in [0, 1]; 0.01 in the
        paper.  At small scale a larger value (0.1) can matter (benchmarks/results).  ``"auto"``
        chooses it per gate/up pair from ``gamma_candidates`` (default 0.01, 0.1, 0.3 and
        1, i.e. SparseGPT) by the MLP block's error on held-out calibration sequences
        (``whisper_modifiers.selection``).
    """

    GAMMA_CANDIDATES = WHISPER_GAMMA_CANDIDATES
    gamma: Gamma = 0.01

    BATCHED_CANDIDATES: ClassVar[bool] = True  # candidate_weights: one batched solve

    def new_statistics(self) -> CalibrationStatistics:
        """Statistics whose Grams stay on the CPU between batches with llmcompressor's
        ``offload_hessians``."""
        return CalibrationStatistics(offload_grams=self.offload_hessians)

    def calibrate_module(self, module, args, _output):
        x, statistics = args[0], self._statistics
        if not self.is_difference_module(module):
            return statistics.add_hessian(module, x)
        if self.pairing == "centered":  # H_c = H - s x_bar x_bar^T: H is computed anyway
            if self._pairs.input_source(module, x) is not module:
                return  # same input as its source: H and H_c are the source's
            statistics.add_hessian(module, x)
            return statistics.add_centering(module, self._pairs.sequence_means(module, x), True)
        differences = self._pairs.sequence_differences(module, x)
        if self._pairs.source(module) is not module:
            return  # same input and pairs as its source: H and H_Delta are the source's
        statistics.add_hessian(module, x)
        statistics.add_difference_hessian(module, differences)

    def compress_modules(self):
        """Form ``H~`` for each difference module, then run SparseGPT's solver on all
        (statistics reduced across ranks first, each module solved on one rank)."""
        self.reduce_and_select()
        for module in self._statistics:
            held = self._statistics[module]
            if held.centering_gram.held:
                held.difference_hessian.total = centered(
                    held.hessian.total, held.centering_gram.total
                )
        for module, source in self._pairs.shared_inputs().items():
            if source in self._statistics:  # this layer
                shared, held = self._statistics[source], self._statistics.of(module)
                held.hessian, held.difference_hessian = (
                    shared.hessian.copy(),
                    shared.difference_hessian,
                )
        for module in self._statistics:
            held = self._statistics[module]
            if self.is_difference_module(module) and not held.difference_hessian.held:
                self._pairs.warn_without_pairs(module, "SparseGPT's H")
            elif held.difference_hessian.held:
                hessian = held.hessian.total
                held.hessian.total = regularized_difference_hessian(
                    hessian, held.difference_hessian.total.to(hessian.device), self.gamma_of(module)
                )
        modules = [m for m in self._module_names if m in self._statistics]
        solve_on_owners(self._statistics, modules, self.solve)

    def regularized_hessian(self, module, gamma: float) -> torch.Tensor:
        """A new ``H~`` of ``module`` at ``gamma`` from the statistics held now (its
        input source's when the input is shared), on its execution device."""
        held = self._statistics[self._pairs.source(module)]
        hessian = held.hessian.total.to(get_execution_device(module))
        if held.centering_gram.held:
            difference_hessian = centered(hessian, held.centering_gram.total)
        else:
            difference_hessian = held.difference_hessian.total.to(hessian.device)
        return regularized_difference_hessian(hessian, difference_hessian, gamma).clone()

    def candidate_weight(self, module, gamma: float) -> torch.Tensor:
        """SparseGPT's solve with ``H~`` at ``gamma`` (the weight is not written)."""
        with torch.no_grad(), align_module_device(module):
            return sparsify_weight(
                module,
                {module: self.regularized_hessian(module, gamma)},
                self._module_sparsities[module],
                self._prune_n,
                self._prune_m,
                self.block_size,
                self.dampening_frac,
                self.preserve_sparsity_mask,
            )[1]

    def candidate_weights(self, group, gammas: list[float]) -> list[dict]:
        """SparseGPT's solve at every candidate gamma, gate and up (same shape and
        sparsity) at all gammas in one batch (``solvers.sparsegpt_prune_batch``, which is
        ``sparsify_weight`` per problem): one loop over the columns instead of one per
        module and gamma."""
        sparsities = {self._module_sparsities[m] for m in group}
        if (
            not self.BATCHED_CANDIDATES
            or self.preserve_sparsity_mask
            or len(sparsities) > 1
            or len({tuple(m.weight.shape) for m in group}) > 1
            or not all(isinstance(m, torch.nn.Linear) for m in group)
        ):
            return super().candidate_weights(group, gammas)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for module in group:
                stack.enter_context(align_module_device(module))
            problems = [(m, gamma) for gamma in gammas for m in group]
            mixed = {}  # H~ per (input source, gamma): gate and up share one
            for m, gamma in problems:
                key = (self._pairs.source(m), gamma)
                if key not in mixed:
                    mixed[key] = self.regularized_hessian(m, gamma).to(m.weight.device)
            pruned = sparsegpt_prune_batch(
                torch.stack([m.weight for m, _ in problems]),
                torch.stack([mixed[self._pairs.source(m), g] for m, g in problems]),
                sparsities.pop(),
                self._prune_n,
                self._prune_m,
                self.block_size,
                self.dampening_frac,
            ).to(group[0].weight.dtype)
        weights = iter(pruned)
        return [{module: next(weights) for module in group} for _ in gammas]

    def solve(self):
        """Prune every module left with statistics with its ``H~`` (``H`` outside the
        difference targets): llmcompressor's SparseGPT solve (``sparsify_weight``)."""
        for module in self._statistics:
            name, hessian = self._module_names[module], self._statistics[module].hessian
            self._statistics.drop(module)
            logger.info(f"Sparsifying {name} using {hessian.count} samples")
            with torch.no_grad(), align_module_device(module), CompressionLogger(module) as log:
                loss, pruned = sparsify_weight(
                    module,
                    {module: hessian.total},
                    self._module_sparsities[module],
                    self._prune_n,
                    self._prune_m,
                    self.block_size,
                    self.dampening_frac,
                    self.preserve_sparsity_mask,
                )
                log.set_results(name="SGPT", loss=loss)
            update_offload_parameter(module, "weight", pruned)


class ALPSWhisperModifier(WhisperModifier):
    """ALPS-Whisper (paper Appendix "Composability"): the ALPS solver (ADMM on the
    ridge-regularised reconstruction objective, then conjugate gradient on the fixed
    support; ``alps.alps_prune``) with Whisper's ``H~`` on the ``difference_targets``
    and ``H`` elsewhere.  The ridge is ``lambda_2 = dampening_frac * mean(diag H)``.
    Unstructured sparsity uses one threshold per layer, as ALPS does.

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        ALPSWhisperModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          gamma: 0.01
          ignore: ["lm_head"]
    ```

    :param alps_rho: initial ADMM penalty (0.1, as the reference).
    :param alps_max_iter: ADMM iteration cap (300).
    :param alps_cg_iter: conjugate-gradient refinement steps (10).
    """

    alps_rho: float = Field(default=0.1, gt=0.0)
    alps_max_iter: int = Field(default=300, ge=1)
    alps_cg_iter: int = Field(default=10, ge=0)

    BATCHED_CANDIDATES: ClassVar[bool] = False  # ALPS at each candidate, one at a time

    def solve(self):
        for module in self._statistics:
            name, held = self._module_names[module], self._statistics[module].hessian
            hessian, count = held.total, held.count
            self._statistics.drop(module)
            logger.info(f"Sparsifying {name} with ALPS using {count} samples")
            with torch.no_grad(), align_module_device(module), CompressionLogger(module):
                result = self._alps(module, hessian)
            logger.info(
                f"{name}: ALPS {result.iterations} ADMM iterations, relative "
                f"reconstruction error {result.objective:.4g}"
            )
            update_offload_parameter(module, "weight", result.weight)

    def candidate_weight(self, module, gamma: float) -> torch.Tensor:
        """ALPS with ``H~`` at ``gamma`` (the weight is not written)."""
        with torch.no_grad(), align_module_device(module):
            return self._alps(module, self.regularized_hessian(module, gamma)).weight

    def _alps(self, module, hessian: torch.Tensor):
        return alps_prune(
            module.weight,
            hessian.to(module.weight.device),
            self._module_sparsities[module],
            self._prune_n,
            self._prune_m,
            ridge_frac=self.dampening_frac,
            rho=self.alps_rho,
            max_iter=self.alps_max_iter,
            cg_iter=self.alps_cg_iter,
        )


class ALPSModifier(ALPSWhisperModifier):
    """ALPS (Meng et al. 2024) as a one-shot modifier: the ALPS solver with ``H = X X^T``
    on every targeted module (``difference_targets`` is empty).

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        ALPSModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          ignore: ["lm_head"]
    ```
    """

    difference_targets: list[str] = Field(default_factory=list)
