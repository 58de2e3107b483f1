"""llmcompressor's Wanda and SparseGPT over ``calibration_statistics``: the stock solvers,
fed float64 sums per sequence instead of float32 running means, so that their masks do not
depend on the batch size or ranks, and a baseline and our method at its baseline's gamma
are the same arithmetic. ``methods.run_oneshot`` swaps llmcompressor's own modifiers for
these (``sequence_sum_baseline``)."""

from __future__ import annotations

import torch
from compressed_tensors.utils import align_module_device, update_offload_parameter
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
from llmcompressor.modifiers.pruning.wanda.wanda_sparsify import WANDA_PRECISION
from llmcompressor.utils.metric_logging import CompressionLogger
from loguru import logger
from pydantic import PrivateAttr

from whisper_modifiers.modifiers.calibration_statistics import (
    CalibrationStatistics,
    ModuleStatistics,
)
from whisper_modifiers.modifiers.distributed import solve_on_owners
from whisper_modifiers.solvers import prune_mask

__all__ = ["SparseGPTBaselineModifier", "WandaBaselineModifier", "sequence_sum_baseline"]


class WandaBaselineModifier(WandaPruningModifier):
    """llmcompressor's ``WandaPruningModifier`` over order-independent statistics, which
    also reduce under torchrun."""

    _statistics: CalibrationStatistics = PrivateAttr(default_factory=CalibrationStatistics)

    def calibrate_module(self, module, args, _output):
        self._statistics.add_channel_norms(module, args[0])

    def compress_modules(self):
        _solve_with_stock(self, self._hand_over, self._prune_all)

    def _hand_over(self, module, held: ModuleStatistics):
        norms = held.channel_norms
        self._row_scalars[module], self._num_samples[module] = norms.total, norms.count

    def _prune_all(self):
        """llmcompressor's Wanda solve (``WandaPruningModifier.compress_modules``), its
        metric ``|W| * sqrt(||X_j||^2)`` in its precision, with the selection in one call
        (``solvers.prune_mask``: one ``topk`` over every group of M columns of the module,
        where ``wanda_sparsify.sparsify_weight`` calls it group by group; the same choice).
        A module ``prune_mask`` cannot take (not a Linear, or N:M over an input size that
        is not a multiple of M) runs the stock solve."""
        stock = []
        for module in list(self._num_samples):
            if not _vectorizable(module, self._prune_m):
                stock.append(module)
                continue
            name, count = self._module_names[module], self._num_samples.pop(module)
            logger.info(f"Sparsifying {name} using {count} samples")
            with torch.no_grad(), align_module_device(module), CompressionLogger(module):
                weight = module.weight.data.to(WANDA_PRECISION)
                metric = weight.abs() * self._row_scalars.pop(module).reshape(1, -1).sqrt()
                mask = prune_mask(
                    metric, self._module_sparsities[module], self._prune_n, self._prune_m
                )
                pruned = weight.masked_fill(mask, 0.0).to(module.weight.dtype)
            update_offload_parameter(module, "weight", pruned)
        if stock:
            self._num_samples = {module: self._num_samples[module] for module in stock}
            super().compress_modules()


def _vectorizable(module: torch.nn.Module, prune_m: int) -> bool:
    return type(module) is torch.nn.Linear and (
        not prune_m or module.weight.shape[1] % prune_m == 0
    )


class SparseGPTBaselineModifier(SparseGPTModifier):
    """llmcompressor's ``SparseGPTModifier`` over order-independent Hessians, which also
    reduce under torchrun."""

    _statistics: CalibrationStatistics = PrivateAttr(default_factory=CalibrationStatistics)

    def on_initialize(self, state, **kwargs) -> bool:
        self._statistics = CalibrationStatistics(offload_grams=self.offload_hessians)
        return super().on_initialize(state, **kwargs)

    def calibrate_module(self, module, args, _output):
        self._statistics.add_hessian(module, args[0])

    def compress_modules(self):
        _solve_with_stock(self, self._hand_over, super().compress_modules)

    def _hand_over(self, module, held: ModuleStatistics):
        hessian = held.hessian
        self._hessians[module], self._num_samples[module] = hessian.total, hessian.count


def _solve_with_stock(modifier, hand_over, stock_solve) -> None:
    """Reduce ``modifier``'s statistics across ranks, hand each module's to the stock
    modifier's own dicts (``hand_over``) and run its own solve (``stock_solve``), each
    module on one rank."""
    statistics = modifier._statistics
    statistics.reduce(modifier._module_names)

    def solve():
        for module in statistics:
            hand_over(module, statistics[module])
            statistics.drop(module)
        stock_solve()

    solve_on_owners(statistics, [m for m in modifier._module_names if m in statistics], solve)


def sequence_sum_baseline(modifier):
    """llmcompressor's own Wanda or SparseGPT modifier (exactly those classes) as the
    baseline with order-independent statistics and the same fields; any other modifier
    unchanged."""
    classes = {
        WandaPruningModifier: WandaBaselineModifier,
        SparseGPTModifier: SparseGPTBaselineModifier,
    }
    cls = classes.get(type(modifier))
    return modifier if cls is None else cls(**modifier.model_dump(exclude_unset=True))
