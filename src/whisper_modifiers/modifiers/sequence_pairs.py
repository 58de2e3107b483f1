"""Pairwise differences drawn within each calibration sequence (mixin of
``DifferencePruningBase``): the seeded pairs of the paper's Section 3.1 (or nearest
neighbours), shared by the modules that receive one input tensor (a gate and an up
projection), an MoE expert's drawn within each sequence's tokens routed to it
(``routed_pairs``), and the per-sequence means of the centered form."""

from __future__ import annotations

import weakref
import zlib

import torch
from pydantic import BaseModel, PrivateAttr

from whisper_modifiers.statistics import (
    nearest_neighbour_differences,
    pair_permutations,
    pairwise_differences,
    scaled_sequence_means,
)

__all__ = ["SequencePairs"]


class SequencePairs(BaseModel):
    """The pairs of every difference module's calibration inputs (fields ``seed``,
    ``num_permutations`` and ``pairing`` are ``DifferencePruningBase``'s)."""

    _pair_sources: dict[torch.nn.Module, torch.nn.Module] = PrivateAttr(default_factory=dict)
    _last_input: tuple | None = PrivateAttr(default=None)
    _last_differences: torch.Tensor | None = PrivateAttr(default=None)
    _centering: dict[torch.nn.Module, tuple[torch.Tensor, int]] = PrivateAttr(default_factory=dict)
    _rows: list[int] = PrivateAttr(default_factory=list)

    def sequence_differences(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Pairwise differences of every sequence (batch row) of a hook's input; for an
        MoE expert, of each sequence's tokens routed to it (``moe_routing``).

        Each row gets its own permutations, seeded by ``(seed, module name, global index
        of the sequence)``, so pairs do not depend on batch size, module order or the
        number of ranks (``distributed.sequence_offset``).  Modules that
        receive the very same input tensor in one forward pass (a gate and an up
        projection) share the pairs of the first of them: the differences are computed
        once, and ``pair_source`` tells which module they were drawn for.

        :return: ``[b, num_permutations * seq_len, m]`` float32; for an expert, a list
            of ``[num_permutations * routed tokens, m]``, one per sequence with at least 2.
        """
        if self.input_source(module, x) is module:
            self._last_differences = self._draw_differences(module, x)
        return self._last_differences

    def input_source(self, module: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
        """The first module that received this very input tensor in this forward pass
        (``module`` itself unless its input is shared, as gate and up share theirs); the
        statistics of the input are computed once, for that module. Recorded as
        ``pair_source``."""
        cached, expert = self._last_input, self._routing.expert_of(module)
        if cached is not None and cached[0]() is x and cached[1:3] == (x._version, expert):
            source = cached[3]
        else:  # every expert may get the same tokens: an expert's pairs are its own
            source = module
            self._last_input = (weakref.ref(x), x._version, expert, module)
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

    def _draw_differences(self, module: torch.nn.Module, x: torch.Tensor):
        if self._routing.is_expert(module):  # sequences whose pairs all vanish add nothing
            pairs = [self._pairs(module, routed.tokens, self._rows[routed.row])
                     for routed in self._routing.routed_sequences(module, x)]  # fmt: skip
            return [differences for differences in pairs if differences.any()]
        if module in self._routing:
            x = self._routing.as_sequences(module, x)
        x = self.check_input(module, x)
        if self.pairing == "centered":
            raise RuntimeError(f"pairing {self.pairing!r} forms no explicit pairs")
        rows = zip(self._rows, x, strict=True)
        return torch.stack([self._pairs(module, sequence, row) for row, sequence in rows])

    def _pairs(self, module: torch.nn.Module, sequence: torch.Tensor, row: int) -> torch.Tensor:
        """The differences of one sequence's tokens ``[tokens, m]``, with global index
        ``row``: seeded by ``(seed, module name, row)``, or nearest neighbours."""
        if self.pairing == "nearest":
            return nearest_neighbour_differences(sequence)
        module_id = zlib.crc32(self._module_names[module].encode())
        permutations = pair_permutations(
            sequence.shape[0], self.num_permutations, (self.seed, module_id, row)
        )
        return pairwise_differences(sequence, permutations)

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
