"""The calibration statistics of one pruning modifier, per module: float64 sums over the
calibration sequences and their counts, reduced across ranks into what the solvers take.
Glue between the hooks and ``statistics``; no maths here.

llmcompressor's SparseGPT and Wanda keep float32 running means over batches, whose
rounding depends on the batch size and on how the sequences are split over ranks (on an
AVX2-only CPU that alone changed 1.1 % of Whisper's 2:4 masks between batch sizes 1 and
4). These are float64 sums of per-sequence float32 terms (``statistics.add_sequence_*``):
the same in any order, so the masks are too. ``reduce`` sums them across ranks and turns
each into float32: ``scale * sum / count`` (``statistics.mean_over_sequences``; scale 2
for a Gram, SparseGPT's ``H = (2 / N) X X^T``), or the float32 sum for Wisp+'s
per-sequence statistics, which its solver divides by their count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
from compressed_tensors.utils import get_execution_device

from whisper_modifiers.modifiers.distributed import all_reduce_sum, is_distributed, sum_over_ranks
from whisper_modifiers.statistics import (
    STATISTICS_DTYPE,
    SUM_DTYPE,
    add_sequence_channel_norms,
    add_sequence_grams,
    mean_over_sequences,
    num_sequences,
)

__all__ = ["CalibrationStatistics", "ModuleStatistics", "SequenceSum"]


class SequenceSum:
    """A statistic of one module summed over calibration sequences (``total``, float64;
    ``None`` until a sequence is added) and how many sequences it holds; after
    ``CalibrationStatistics.reduce``, the float32 value the solver takes."""

    __slots__ = ("count", "total")

    def __init__(self, total: torch.Tensor | None = None, count: int = 0):
        self.total, self.count = total, count

    @property
    def held(self) -> bool:
        return self.total is not None

    def add_sequences(self, term: Callable, x, device, offload: bool = False) -> None:
        """Add ``term``'s value (``add_sequence_grams`` or ``add_sequence_channel_norms``)
        for each sequence of ``x`` (``[b, tokens, m]``, ``[tokens, m]`` or a list of
        ``[tokens, m]``), summed on ``device``; kept on the CPU with ``offload``."""
        if num_sequences(x) == 0:
            return  # an MoE expert's batch without a sequence of 2 routed tokens
        x = [sequence.to(device) for sequence in x] if isinstance(x, list) else x.to(device)
        total = term(None if self.total is None else self.total.to(device), x)
        self.total = total.cpu() if offload else total
        self.count += num_sequences(x)

    def add(self, value: torch.Tensor) -> None:
        """Add one sequence's value (Wisp+'s per-sequence statistics)."""
        if self.total is None:
            self.total = value.to(SUM_DTYPE)
        else:
            self.total += value
        self.count += 1

    def copy(self) -> SequenceSum:
        return SequenceSum(None if self.total is None else self.total.clone(), self.count)

    def minus(self, part: SequenceSum) -> SequenceSum:
        """The sum of the sequences outside ``part``, in a new tensor."""
        if not part.held:
            return self.copy()
        return SequenceSum(self.total - part.total.to(self.total.device), self.count - part.count)


class _Kind(NamedTuple):
    """How a statistic reduces: its shape for a ``[n, m]`` weight, and the scale of its
    mean (``None``: kept as a float32 sum)."""

    shape: Callable[[int, int], tuple[int, ...]]
    scale: float | None


GRAM = _Kind(lambda n, m: (m, m), 2.0)
CHANNELS = _Kind(lambda n, m: (m,), 1.0)
WEIGHT_SHAPED = _Kind(lambda n, m: (n, m), None)
NEURONS = _Kind(lambda n, m: (n,), None)


def _statistic(kind: _Kind):
    return dataclasses.field(default_factory=SequenceSum, metadata={"kind": kind})


@dataclasses.dataclass
class ModuleStatistics:
    """Every statistic a modifier keeps of one module (each ``held`` or not)."""

    hessian: SequenceSum = _statistic(GRAM)  # X X^T: SparseGPT's H
    difference_hessian: SequenceSum = _statistic(GRAM)  # dX dX^T: Whisper's H_Delta
    channel_norms: SequenceSum = _statistic(CHANNELS)  # ||X_j||^2 (Wanda), ||dX_j||^2 (Wisp)
    plain_norms: SequenceSum = _statistic(CHANNELS)  # ||X_j||^2 beside a difference statistic
    centering_gram: SequenceSum = _statistic(GRAM)  # s x_bar x_bar^T: H_c = H - it
    centering_norms: SequenceSum = _statistic(CHANNELS)  # its diagonal
    neuronwise: SequenceSum = _statistic(WEIGHT_SHAPED)  # Wisp+'s a_ij, per sequence
    difficulty: SequenceSum = _statistic(NEURONS)  # the mapping difficulty, per sequence

    def statistics(self) -> Iterator[tuple[str, _Kind, SequenceSum]]:
        for field in dataclasses.fields(self):
            yield field.name, field.metadata["kind"], getattr(self, field.name)

    def copy(self) -> ModuleStatistics:
        return ModuleStatistics(**{name: held.copy() for name, _, held in self.statistics()})

    def minus(self, part: ModuleStatistics | None) -> ModuleStatistics:
        """The statistics of the sequences outside ``part`` (``None``: none), in new tensors."""
        if part is None:
            return self.copy()
        return ModuleStatistics(
            **{name: held.minus(getattr(part, name)) for name, _, held in self.statistics()}
        )

    def fall_back_to_plain(self) -> None:
        """Drop the difference statistics and take ``||X_j||^2`` as the channel statistic:
        an MoE expert that no calibration sequence sent 2 tokens has no pair."""
        self.channel_norms, self.plain_norms = self.plain_norms, SequenceSum()
        self.difference_hessian, self.neuronwise, self.difficulty = (
            SequenceSum(),
            SequenceSum(),
            SequenceSum(),
        )


class CalibrationStatistics:
    """The ``ModuleStatistics`` of every module a modifier calibrates, in the order they
    were first added to; ``offload_grams`` keeps the Gram sums on the CPU between
    batches (llmcompressor's ``offload_hessians``)."""

    def __init__(self, offload_grams: bool = False):
        self.offload_grams = offload_grams
        self._modules: dict[torch.nn.Module, ModuleStatistics] = {}

    def __contains__(self, module: torch.nn.Module) -> bool:
        return module in self._modules

    def __getitem__(self, module: torch.nn.Module) -> ModuleStatistics:
        return self._modules[module]

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(list(self._modules))

    def __len__(self) -> int:
        return len(self._modules)

    def of(self, module: torch.nn.Module) -> ModuleStatistics:
        """``module``'s statistics, created empty on first use."""
        return self._modules.setdefault(module, ModuleStatistics())

    # -- adding a hook's sequences -------------------------------------------------------

    def add_hessian(self, module: torch.nn.Module, x) -> None:
        """Add ``X X^T`` of each sequence of ``x`` (SparseGPT's ``H``)."""
        self._add_grams(self.of(module).hessian, module, x)

    def add_difference_hessian(self, module: torch.nn.Module, differences) -> None:
        """Add ``dX dX^T`` of each sequence's differences (Whisper's ``H_Delta``)."""
        self._add_grams(self.of(module).difference_hessian, module, differences)

    def add_channel_norms(self, module: torch.nn.Module, x) -> None:
        """Add ``||X_j||^2`` (Wanda) or, on differences, ``||dX_j||^2`` (Wisp)."""
        self._add_norms(self.of(module).channel_norms, module, x)

    def add_plain_norms(self, module: torch.nn.Module, x) -> None:
        """Add ``||X_j||^2`` beside a difference statistic (a mixture, an expert)."""
        self._add_norms(self.of(module).plain_norms, module, x)

    def add_centering(self, module: torch.nn.Module, means: torch.Tensor, gram: bool) -> None:
        """Add ``s x_bar x_bar^T`` of each sequence (``means``: ``statistics.
        scaled_sequence_means``), or its diagonal: subtracted from ``H`` (``||X_j||^2``)
        it gives the centered statistic (appendix "Centering")."""
        statistics = self.of(module)
        if gram:
            statistics.centering_gram.add_sequences(add_sequence_grams, means, means.device)
        else:
            statistics.centering_norms.add_sequences(
                add_sequence_channel_norms, means, means.device
            )

    def _add_grams(self, held: SequenceSum, module: torch.nn.Module, x) -> None:
        device = get_execution_device(module)
        held.add_sequences(add_sequence_grams, x, device, offload=self.offload_grams)

    def _add_norms(self, held: SequenceSum, module: torch.nn.Module, x) -> None:
        held.add_sequences(add_sequence_channel_norms, x, get_execution_device(module))

    # -- sets of statistics (``gamma: auto``'s folds) and owners ---------------------------

    def copy(self, modules: Iterable[torch.nn.Module]) -> CalibrationStatistics:
        """A copy of the statistics of ``modules``, sharing no tensor with these."""
        copied, modules = CalibrationStatistics(self.offload_grams), set(modules)
        copied._modules = {m: s.copy() for m, s in self._modules.items() if m in modules}
        return copied

    def without(self, part: CalibrationStatistics) -> CalibrationStatistics:
        """These statistics less ``part``'s (a fold's), in new tensors."""
        remaining = CalibrationStatistics(self.offload_grams)
        remaining._modules = {m: s.minus(part._modules.get(m)) for m, s in self._modules.items()}
        return remaining

    def drop(self, module: torch.nn.Module) -> None:
        self._modules.pop(module, None)

    def keep_only(self, modules: Iterable[torch.nn.Module]) -> None:
        kept = set(modules)
        self._modules = {m: s for m, s in self._modules.items() if m in kept}

    # -- reduction -----------------------------------------------------------------------

    def reduce(self, order: Iterable[torch.nn.Module]) -> None:
        """Sum every statistic over ranks (float64; nothing to sum in one process) and
        replace it by what the solvers take (module docstring). ``order`` (the modifier's
        registration order) is every rank's, so every rank takes part in the same
        collectives; a rank that summed nothing of a statistic adds zeros."""
        order = [module for module in order if is_distributed() or module in self._modules]
        present, counts = self._held_everywhere(order)
        for index, module in enumerate(order):
            if not present[index, 0]:
                continue
            statistics = self.of(module)
            n, m = module.weight.shape
            for column, (_, kind, held) in enumerate(statistics.statistics(), start=1):
                if not present[index, column]:
                    continue
                total = sum_over_ranks(held.total, kind.shape(n, m))
                held.count = int(counts[index, column])
                if kind.scale is None:
                    held.total = total.to(STATISTICS_DTYPE)
                else:
                    held.total = mean_over_sequences(total, held.count, kind.scale)

    def _held_everywhere(self, order: list[torch.nn.Module]) -> tuple:
        """``[modules, 1 + statistics]`` of whether any rank holds the module (column 0)
        and each statistic, and the counts summed over ranks (two collectives)."""
        width = 1 + len(dataclasses.fields(ModuleStatistics))
        present = torch.zeros(len(order), width, dtype=torch.float64)
        counts = torch.zeros(len(order), width, dtype=torch.float64)
        for index, module in enumerate(order):
            if module not in self._modules:
                continue
            present[index, 0] = 1
            for column, (_, _, held) in enumerate(self._modules[module].statistics(), start=1):
                present[index, column], counts[index, column] = held.held, held.count
        if is_distributed():
            present, counts = all_reduce_sum(present), all_reduce_sum(counts)
        return present > 0, counts
