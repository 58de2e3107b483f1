"""llmcompressor's Wanda and SparseGPT over ``calibration_statistics``: the stock solvers,
fed float64 sums per sequence instead of float32 running means, so that their masks do not
depend on the batch size or ranks, and a baseline and our method at its baseline's gamma
are the same arithmetic. ``methods.run_oneshot`` swaps llmcompressor's own modifiers for
these (``sequence_sum_baseline``)."""

from __future__ import annotations

from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
from pydantic import PrivateAttr

from whisper_modifiers.modifiers.calibration_statistics import (
    CalibrationStatistics,
    ModuleStatistics,
)
from whisper_modifiers.modifiers.distributed import solve_on_owners

__all__ = ["SparseGPTBaselineModifier", "WandaBaselineModifier", "sequence_sum_baseline"]


class WandaBaselineModifier(WandaPruningModifier):
    """llmcompressor's ``WandaPruningModifier`` over order-independent statistics, which
    also reduce under torchrun."""

    _statistics: CalibrationStatistics = PrivateAttr(default_factory=CalibrationStatistics)

    def calibrate_module(self, module, args, _output):
        self._statistics.add_channel_norms(module, args[0])

    def compress_modules(self):
        _solve_with_stock(self, self._hand_over, super().compress_modules)

    def _hand_over(self, module, held: ModuleStatistics):
        norms = held.channel_norms
        self._row_scalars[module], self._num_samples[module] = norms.total, norms.count


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
