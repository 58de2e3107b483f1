"""Calibration statistics summed per sequence in float64, and llmcompressor's baselines
over them: glue between the modifiers and ``statistics``; no maths here.

llmcompressor's SparseGPT and Wanda keep their statistics as float32 running means over
batches, whose rounding depends on the batch size and on how sequences are split over
ranks; on an AVX2-only CPU that alone changed 1.1 % of Whisper's 2:4 masks between batch
sizes 1 and 4. ``SequenceSumCalibration`` keeps float64 sums of per-sequence float32 terms
instead (``statistics.add_sequence_*``): the same in any order, so the masks are too.
``distributed.reduce_statistics`` turns them into the float32 means the solvers take.
``methods.run_oneshot`` runs llmcompressor's own modifiers as ``SparseGPTBaselineModifier``
/ ``WandaBaselineModifier`` (``sequence_sum_baseline``): the same solvers over these
statistics, so a baseline and our method at its baseline's gamma are the same arithmetic.
"""

from __future__ import annotations

import torch
from compressed_tensors.utils import get_execution_device
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier

from whisper_modifiers.modifiers.distributed import reduce_statistics, solve_on_owners
from whisper_modifiers.statistics import (
    add_sequence_channel_norms,
    add_sequence_grams,
    num_sequences,
)

__all__ = [
    "SequenceSumCalibration",
    "SparseGPTBaselineModifier",
    "WandaBaselineModifier",
    "sequence_sum_baseline",
]


class SequenceSumCalibration:
    """``calibrate_module`` of llmcompressor's SparseGPT (``add_hessian``) and Wanda
    (``add_row_scalars``) with the statistic summed per sequence in float64
    (``statistics.add_sequence_*``) instead of a float32 running mean: the same numbers up
    to float32 rounding, but the same bits whatever the batch size and ranks.
    ``reduce_statistics`` turns the sums into the means the solvers take."""

    def add_sequences(self, statistic: str, count: str, module: torch.nn.Module,
                      x: torch.Tensor, add) -> None:  # fmt: skip
        """Add ``add``'s term of each sequence of ``x`` (``add_sequence_grams`` or
        ``add_sequence_channel_norms``) to ``module``'s float64 sum in the dict attribute
        ``statistic``, and the sequences to its ``count`` (one of ``SEQUENCE_SUMS``' pairs);
        ``x`` is ``[b, tokens, m]``, ``[tokens, m]`` or a list of ``[tokens, m]``.
        Summed on the module's execution device; a Gram sum is kept on the CPU between
        batches with ``offload_hessians``."""
        if num_sequences(x) == 0:
            return  # an MoE expert's batch without a sequence of 2 routed tokens
        sums, counts = getattr(self, statistic), getattr(self, count)
        device = get_execution_device(module)
        total = sums.get(module)
        x = [sequence.to(device) for sequence in x] if isinstance(x, list) else x.to(device)
        total = add(None if total is None else total.to(device), x)
        offload = add is add_sequence_grams and getattr(self, "offload_hessians", False)
        sums[module] = total.cpu() if offload else total
        counts[module] = counts.get(module, 0) + num_sequences(x)

    def add_hessian(self, module: torch.nn.Module, x: torch.Tensor) -> None:
        """Add ``X X^T`` of each sequence of ``x`` to ``module``'s Hessian sum."""
        self.add_sequences("_hessians", "_num_samples", module, x, add_sequence_grams)

    def add_row_scalars(self, module: torch.nn.Module, x: torch.Tensor) -> None:
        """Add ``||X_j||^2`` of each sequence of ``x`` to ``module``'s Wanda statistic."""
        self.add_sequences("_row_scalars", "_num_samples", module, x, add_sequence_channel_norms)


class _OwnerSolving:
    """``compress_modules`` of a stock modifier, with statistics summed across ranks and
    each module solved on one rank."""

    def compress_modules(self):
        reduce_statistics(self)
        modules = [m for m in self._module_names if m in self._num_samples]
        solve_on_owners(self, modules, super().compress_modules)


class WandaBaselineModifier(_OwnerSolving, SequenceSumCalibration, WandaPruningModifier):
    """llmcompressor's ``WandaPruningModifier`` over order-independent statistics, which
    also reduce under torchrun."""

    def calibrate_module(self, module, args, _output):
        self.add_row_scalars(module, args[0])


class SparseGPTBaselineModifier(_OwnerSolving, SequenceSumCalibration, SparseGPTModifier):
    """llmcompressor's ``SparseGPTModifier`` over order-independent Hessians, which also
    reduce under torchrun."""

    def calibrate_module(self, module, args, _output):
        self.add_hessian(module, args[0])


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
