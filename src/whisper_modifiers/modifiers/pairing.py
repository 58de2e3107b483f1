"""The pairs of a difference modifier (a part it holds): pairwise differences drawn within
each calibration sequence (paper Section 3.1, or nearest neighbours), shared by the
modules that receive one input tensor (a gate and an up projection); for an MoE expert,
drawn within each sequence's tokens routed to it (``moe_routing``); and the per-sequence
means of the centered form (appendix "Centering")."""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable

import torch
from loguru import logger

from whisper_modifiers.modifiers.moe_routing import MoERouting
from whisper_modifiers.statistics import (
    nearest_neighbour_differences,
    pair_permutations,
    pairwise_differences,
    scaled_sequence_means,
)

__all__ = ["Pairing"]


class Pairing:
    """The pairs of every difference module of one modifier.

    :param mode: the modifier's ``pairing`` (``random``, ``nearest`` or ``centered``).
    :param seed: the modifier's ``seed``; with ``num_permutations``, the permutations.
    :param module_names: the modifier's ``{module: name}`` (names seed the pairs).
    :param owner: the modifier's class name, for messages.
    """

    def __init__(
        self,
        mode: str,
        seed: int,
        num_permutations: int,
        module_names: dict[torch.nn.Module, str],
        owner: str,
    ):
        self.mode, self.seed, self.num_permutations = mode, seed, num_permutations
        self.module_names, self.owner = module_names, owner
        self.routing = MoERouting()
        self.rows: list[int] = []  # global indices of the sequences of the hook's input
        self._sources: dict[torch.nn.Module, torch.nn.Module] = {}
        self._last_input: tuple | None = None
        self._last_differences = None
        self._routing_skips: dict[str, tuple[int, int]] = {}

    # -- MoE routing ---------------------------------------------------------------------

    def watch_routing(
        self,
        model: torch.nn.Module,
        modules: list[tuple],
        register_hook: Callable,
        refused: dict[str, bool],
    ) -> None:
        """Follow the routing of the difference modules ``[(name, module)]`` inside MoE
        blocks (experts, and shared experts fed the block's flattened tokens). Before
        calibration, refuses each setting of ``refused`` (``{"gamma: auto": set, ...}``):
        their statistics need whole sequences there."""
        self.routing = MoERouting()
        self.routing.watch(model, modules, register_hook)
        routed = [name for name, module in modules if module in self.routing]
        for setting, chosen in refused.items():
            if chosen and routed:
                raise ValueError(
                    f"{setting} is not available for MoE experts and the shared experts of "
                    f"MoE blocks ({routed[0]}, ... {len(routed)} in all): set "
                    f"{setting.split(':')[0]} otherwise, or leave them out of difference_targets"
                )

    def batch_size(self, module: torch.nn.Module, x: torch.Tensor) -> int:
        """How many calibration sequences a hook's input holds."""
        if module in self.routing:  # the MoE block's batch, flattened
            return self.routing.batch_size(module)
        return x.shape[0] if x.dim() == 3 else 1

    def end_layer(self) -> None:
        """Forget the layer's last batch; log and keep how many (expert, sequence) pairs
        had fewer than 2 routed tokens, and so gave no pair."""
        self._last_input = self._last_differences = None
        skipped = self.routing.skipped
        if skipped:
            few, everything = (sum(counts[i] for counts in skipped.values()) for i in (0, 1))
            logger.info(
                f"{self.owner}: {few} of {everything} (expert, calibration sequence) pairs "
                f"had fewer than 2 routed tokens and gave no pairs ({len(skipped)} experts)"
            )
            for module, counts in skipped.items():
                self._routing_skips[self.module_names[module]] = tuple(counts)
        self.routing.release()

    def release(self) -> None:
        """Forget everything but the routing skips (the end of the run)."""
        self.routing, self._sources, self._last_input, self._last_differences = (
            MoERouting(),
            {},
            None,
            None,
        )

    def routing_skips(self) -> dict[str, tuple[int, int]]:
        """``{expert module: (sequences with fewer than 2 routed tokens, sequences)}``."""
        return dict(self._routing_skips)

    def warn_without_pairs(self, module: torch.nn.Module, baseline: str) -> None:
        logger.warning(
            f"{self.module_names[module]} received fewer than 2 tokens of every calibration "
            f"sequence, so no pair: it is pruned with {baseline}"
        )

    # -- pairs ---------------------------------------------------------------------------

    def sequence_differences(self, module: torch.nn.Module, x: torch.Tensor):
        """Pairwise differences of every sequence (batch row) of a hook's input; for an
        MoE expert, of each sequence's tokens routed to it.

        Each row gets its own permutations, seeded by ``(seed, module name, global index
        of the sequence)`` (``rows``), so pairs do not depend on batch size, module order
        or the number of ranks. Modules that receive the very same input tensor in one
        forward pass (a gate and an up projection) share the pairs of the first of them
        (``source``).

        :return: ``[b, num_permutations * seq_len, m]`` float32; for an expert, a list
            of ``[num_permutations * routed tokens, m]``, one per sequence with at least 2.
        """
        if self.input_source(module, x) is module:
            self._last_differences = self._draw(module, x)
        return self._last_differences

    def input_source(self, module: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
        """The first module that received this very input tensor in this forward pass
        (``module`` itself unless its input is shared, as gate and up share theirs): the
        statistics of the input are computed once, for it."""
        cached, expert = self._last_input, self.routing.expert_of(module)
        if cached is not None and cached[0]() is x and cached[1:3] == (x._version, expert):
            source = cached[3]
        else:  # every expert may get the same tokens: an expert's pairs are its own
            source = module
            self._last_input = (weakref.ref(x), x._version, expert, module)
        if self._sources.setdefault(module, source) is not source:
            raise RuntimeError(
                f"{self.module_names[module]} shared its input with "
                f"{self.module_names[source]} in one batch but not in another"
            )
        return source

    def source(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module whose input statistics ``module`` uses (itself unless shared)."""
        return self._sources.get(module, module)

    def shared_inputs(self) -> dict[torch.nn.Module, torch.nn.Module]:
        """``{module: source}`` of the modules whose input was another's."""
        return {module: source for module, source in self._sources.items() if source is not module}

    def sequence_means(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``sqrt(s) x_bar`` of each sequence of a hook's input (the centered form)."""
        return scaled_sequence_means(self._check_input(module, x))

    def _check_input(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A hook's input as ``[b, seq_len, m]``, with at least 2 tokens per sequence."""
        if x.dim() == 2:
            x = x.unsqueeze(0)
        if x.shape[1] < 2:
            raise ValueError(
                f"{self.module_names[module]} received a calibration sequence of "
                f"{x.shape[1]} token(s); {self.owner} forms pairs within each sequence and "
                "needs at least 2 tokens per sequence (raise max_seq_length or drop short "
                "samples)"
            )
        return x

    def _draw(self, module: torch.nn.Module, x: torch.Tensor):
        if self.routing.is_expert(module):  # sequences whose pairs all vanish add nothing
            pairs = [
                self._pairs(module, routed.tokens, self.rows[routed.row])
                for routed in self.routing.routed_sequences(module, x)
            ]
            return [differences for differences in pairs if differences.any()]
        if module in self.routing:
            x = self.routing.as_sequences(module, x)
        x = self._check_input(module, x)
        if self.mode == "centered":
            raise RuntimeError(f"pairing {self.mode!r} forms no explicit pairs")
        rows = zip(self.rows, x, strict=True)
        return torch.stack([self._pairs(module, sequence, row) for row, sequence in rows])

    def _pairs(self, module: torch.nn.Module, sequence: torch.Tensor, row: int) -> torch.Tensor:
        """The differences of one sequence's tokens ``[tokens, m]``, with global index
        ``row``: seeded by ``(seed, module name, row)``, or nearest neighbours."""
        if self.mode == "nearest":
            return nearest_neighbour_differences(sequence)
        module_id = zlib.crc32(self.module_names[module].encode())
        permutations = pair_permutations(
            sequence.shape[0], self.num_permutations, (self.seed, module_id, row)
        )
        return pairwise_differences(sequence, permutations)
