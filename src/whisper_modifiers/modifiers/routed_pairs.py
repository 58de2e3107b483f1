"""The MoE side of a difference modifier (mixin): which of its difference modules sit in
MoE blocks, their routing (``moe_routing``), the settings they cannot take, and the count
of sequences that gave an expert no pair."""

from __future__ import annotations

import torch
from loguru import logger
from pydantic import BaseModel, PrivateAttr

from whisper_modifiers.modifiers.moe_routing import MoERouting

__all__ = ["RoutedPairs"]


class RoutedPairs(BaseModel):
    """Routing of the difference modules inside MoE blocks, for ``DifferencePruningBase``."""

    _routing: MoERouting = PrivateAttr(default_factory=MoERouting)
    _routing_skips: dict[str, tuple[int, int]] = PrivateAttr(default_factory=dict)

    def watch_routing(self, model: torch.nn.Module, modules: list[tuple]) -> None:
        """Follow the routing of the difference modules ``[(name, module)]`` inside MoE
        blocks (experts, and shared experts fed the block's flattened tokens). Refuses,
        before calibration, the settings whose statistics need whole sequences there."""
        self._routing, self._routing_skips = MoERouting(), dict()
        self._routing.watch(model, modules, self.register_hook)
        routed = [name for name, module in modules if module in self._routing]
        for value, field in ((self.gamma == "auto", "gamma: auto"),
                             (self.pairing == "centered", "pairing: centered")):  # fmt: skip
            if value and routed:
                raise ValueError(
                    f"{field} is not available for MoE experts and the shared experts of "
                    f"MoE blocks ({routed[0]}, ... {len(routed)} in all): set "
                    f"{field.split(':')[0]} otherwise, or leave them out of difference_targets"
                )

    def log_routing_skips(self) -> None:
        """At the end of a layer: log how many (expert, sequence) pairs had fewer than 2
        routed tokens, and so gave no pair; keep the counts per expert."""
        skipped = self._routing.skipped
        if skipped:
            few, everything = (sum(counts[i] for counts in skipped.values()) for i in (0, 1))
            logger.info(
                f"{type(self).__name__}: {few} of {everything} (expert, calibration "
                f"sequence) pairs had fewer than 2 routed tokens and gave no pairs "
                f"({len(skipped)} experts)"
            )
            for module, counts in skipped.items():
                self._routing_skips[self._module_names[module]] = tuple(counts)
        self._routing.release()

    def warn_without_pairs(self, module: torch.nn.Module, baseline: str) -> None:
        """Say that ``module`` (an MoE expert no calibration sequence sent 2 tokens) has no
        pair, and is pruned with ``baseline``."""
        logger.warning(
            f"{self._module_names[module]} received fewer than 2 tokens of every calibration "
            f"sequence, so no pair: it is pruned with {baseline}"
        )

    def routing_skips(self) -> dict[str, tuple[int, int]]:
        """``{expert module: (sequences with fewer than 2 routed tokens, sequences)}`` of
        the last calibration (the modules that drew the pairs: an expert's gate)."""
        return dict(self._routing_skips)
