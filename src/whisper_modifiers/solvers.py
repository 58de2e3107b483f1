"""Pruning solvers, as pure torch functions.

* ``prune_by_score`` -- the no-update solver of Wanda, Wisp and Wisp+: keep the
  highest-scoring weights of each output row (per-row comparison group, as Wanda and the
  paper's pseudocode do) or of each group of ``M`` consecutive inputs for N:M sparsity.
* The SparseGPT / OBS solver (block-wise mask selection and weight update) is
  llmcompressor's own ``sgpt_sparsify.sparsify_weight``; Whisper hands it ``H~`` in place
  of ``H``, so it is reused, not rewritten.
"""

from __future__ import annotations

import torch

__all__ = ["prune_mask", "prune_by_score"]


def prune_mask(
    scores: torch.Tensor, sparsity: float, prune_n: int = 0, prune_m: int = 0
) -> torch.Tensor:
    """Boolean mask (``True`` = prune) of the lowest scores.

    Unstructured (``prune_n == 0``): in every row, the ``int(m * sparsity)`` lowest
    scores (stable sort, so ties break by column index).  N:M: in every group of
    ``prune_m`` consecutive columns, the ``prune_n`` lowest scores.  The same selection
    as llmcompressor's Wanda, so a Wanda score gives Wanda's mask bit for bit.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be 2-d [n, m], got shape {tuple(scores.shape)}")
    rows, columns = scores.shape
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if prune_n:
        if columns % prune_m:
            raise ValueError(
                f"mask_structure {prune_n}:{prune_m} needs an input size divisible by "
                f"{prune_m}, got {columns}"
            )
        groups = scores.reshape(rows, columns // prune_m, prune_m)
        lowest = groups.topk(prune_n, dim=-1, largest=False).indices
        mask.view(rows, columns // prune_m, prune_m).scatter_(-1, lowest, True)
    else:
        lowest = torch.sort(scores, dim=-1, stable=True).indices[:, : int(columns * sparsity)]
        mask.scatter_(1, lowest, True)
    return mask


def prune_by_score(
    weight: torch.Tensor,
    scores: torch.Tensor,
    sparsity: float,
    prune_n: int = 0,
    prune_m: int = 0,
) -> torch.Tensor:
    """Zero the lowest-scoring weights (no update of the survivors); returns a copy."""
    pruned = weight.clone()
    pruned[prune_mask(scores, sparsity, prune_n, prune_m)] = 0
    return pruned
