"""RIA (Zhang et al. 2024) and its composites with Wisp and Wisp+ (paper Appendix
"Composability"): RIA's saliency over Wisp's or Wisp+'s channel statistic."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from whisper_modifiers.modifiers.wisp import WispModifier, WispPlusModifier
from whisper_modifiers.solvers import ria_scores

__all__ = ["RIAModifier", "RIAWispModifier", "RIAWispPlusModifier"]


class RIAWispModifier(WispModifier):
    """RIA-Wisp (paper Appendix "Composability"): RIA's saliency, ``(|W_ij| / ||W_:j||_1 +
    |W_ij| / ||W_i:||_1) * c^a``, with ``c = ||dX_j||_2`` on the ``difference_targets``
    (gate/up) and ``||X_j||_2`` (plain RIA) elsewhere.

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        RIAWispModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          ignore: ["lm_head"]
    ```

    :param ria_exponent: ``a``; 0.5 as in RIA and the paper.
    :param comparison_group: ``"layer"`` by default, as RIA's reference implementation
        and its published numbers use; ``"row"`` for Wanda's per-row groups.
    """

    ria_exponent: float = Field(default=0.5, gt=0.0)
    comparison_group: Literal["row", "layer"] = "layer"

    def scores(self, weight: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
        return ria_scores(weight, channel_scale, self.ria_exponent)


class RIAWispPlusModifier(WispPlusModifier):
    """RIA-Wisp+: RIA's saliency (``RIAWispModifier``) with Wisp+'s ``a_ij`` on the
    ``difference_targets``, plain RIA elsewhere.

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        RIAWispPlusModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          ignore: ["lm_head"]
    ```

    Fields: ``WispPlusModifier``'s, with ``RIAWispModifier``'s ``ria_exponent`` and
    ``comparison_group``.
    """

    ria_exponent: float = Field(default=0.5, gt=0.0)
    comparison_group: Literal["row", "layer"] = "layer"
    scores = RIAWispModifier.scores


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
