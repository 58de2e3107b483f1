"""Pruning solvers, as pure torch functions.

* ``prune_mask`` / ``prune_by_score`` -- the no-update solver of magnitude, Wanda, Wisp,
  Wisp+ and RIA: keep the highest scores of each output row (Wanda's comparison group),
  of the whole layer (RIA's reference default), or of each group of ``M`` consecutive
  inputs (N:M).
* ``wanda_scores`` / ``ria_scores`` -- the saliencies over a channel statistic.
* ALPS lives in ``alps.py`` (``alps_prune``), beside these.
* The SparseGPT / OBS solver is llmcompressor's own ``sgpt_sparsify.sparsify_weight``;
  Whisper hands it ``H~`` in place of ``H``, so it is reused, not rewritten.
  ``sparsegpt_prune_batch`` runs the same steps on a batch of independent problems at
  once; ``gamma: auto`` uses it to prune gate and up at every candidate gamma in one
  loop over the columns (its tests hold it to ``sparsify_weight``).
"""

from __future__ import annotations

import torch

__all__ = [
    "prune_by_score",
    "prune_mask",
    "ria_scores",
    "sparsegpt_prune_batch",
    "wanda_scores",
]

COMPARISON_GROUPS = ("row", "layer")


def prune_mask(
    scores: torch.Tensor,
    sparsity: float,
    prune_n: int = 0,
    prune_m: int = 0,
    comparison_group: str = "row",
) -> torch.Tensor:
    """Boolean mask (``True`` = prune) of the lowest scores.

    N:M (``prune_n > 0``): in every group of ``prune_m`` consecutive columns of a row,
    the ``prune_n`` lowest.  Unstructured, ``comparison_group="row"``: in every row the
    ``int(m * sparsity)`` lowest (stable sort: ties break by column index) -- the same
    selection as llmcompressor's Wanda, bit for bit; ``"layer"``: the
    ``int(n * m * sparsity)`` lowest of the whole matrix.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be 2-d [n, m], got shape {tuple(scores.shape)}")
    if comparison_group not in COMPARISON_GROUPS:
        raise ValueError(
            f"comparison_group must be one of {COMPARISON_GROUPS}, got {comparison_group!r}"
        )
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
    elif comparison_group == "row":
        lowest = torch.sort(scores, dim=-1, stable=True).indices[:, : int(columns * sparsity)]
        mask.scatter_(1, lowest, True)
    else:
        flat = torch.sort(scores.reshape(-1), stable=True).indices
        mask.view(-1)[flat[: int(scores.numel() * sparsity)]] = True
    return mask


def prune_by_score(
    weight: torch.Tensor,
    scores: torch.Tensor,
    sparsity: float,
    prune_n: int = 0,
    prune_m: int = 0,
    comparison_group: str = "row",
) -> torch.Tensor:
    """Zero the lowest-scoring weights (no update of the survivors); returns a copy."""
    pruned = weight.clone()
    pruned[prune_mask(scores, sparsity, prune_n, prune_m, comparison_group)] = 0
    return pruned


def wanda_scores(weight: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """``S_ij = |W_ij| * c_j`` (Wanda: ``c = ||X_j||``, Wisp: ``||dX_j||``) or, with an
    ``[n, m]`` statistic, ``|W_ij| * c_ij`` (Wisp+: ``c = a``)."""
    scale = channel_scale.reshape(1, -1) if channel_scale.dim() == 1 else channel_scale
    return weight.abs().float() * scale


def ria_scores(
    weight: torch.Tensor, channel_scale: torch.Tensor, exponent: float = 0.5
) -> torch.Tensor:
    """RIA's relative importance times activations (Zhang et al. 2024; paper Appendix
    "Composability"): ``(|W_ij| / ||W_:j||_1 + |W_ij| / ||W_i:||_1) * c^a``, ``a = 0.5``.

    ``c`` is ``||X_j||`` (RIA), ``||dX_j||`` (RIA-Wisp) or Wisp+'s ``a_ij`` (RIA-Wisp+).
    """
    magnitude = weight.abs().float()
    relative = magnitude / magnitude.sum(dim=0, keepdim=True) + magnitude / magnitude.sum(
        dim=1, keepdim=True
    )
    relative = torch.nan_to_num(relative)  # an all-zero row or column scores 0
    scale = channel_scale.reshape(1, -1) if channel_scale.dim() == 1 else channel_scale
    return relative * scale.float().pow(exponent)


@torch.no_grad()
def sparsegpt_prune_batch(
    weights: torch.Tensor,
    hessians: torch.Tensor,
    sparsity: float,
    prune_n: int = 0,
    prune_m: int = 0,
    block_size: int = 128,
    dampening_frac: float = 0.01,
) -> torch.Tensor:
    """SparseGPT (Frantar & Alistarh 2023, Algorithm 1) on ``B`` independent problems:
    ``weights`` ``[B, rows, columns]`` with ``hessians`` ``[B, columns, columns]``
    (``H``, or Whisper's ``H~``, eq. for ``H~`` in Section 3); returns the pruned
    weights, float32.

    The steps of llmcompressor's ``sparsify_weight`` (without ``preserve_sparsity_mask``):
    dead inputs (``H_jj = 0``) are zeroed; ``H + d I`` with ``d = dampening_frac *
    mean(diag H)`` is inverted and its inverse factored, ``Hinv = chol(H^-1)^T``
    (upper), a singular one falling back to the identity.  (llmcompressor's batched
    ``gptq.helpers.factorize_hessian`` does this too, but its in-place per-item path
    differs from ``sparsify_weight`` in the last bit.)  Column by column
    within blocks of ``block_size``, weights of least ``w^2 / Hinv_jj^2`` are pruned
    (``prune_n`` of every ``prune_m`` inputs of each row, or the ``sparsity`` fraction of
    each block of the whole matrix) and the error ``(w - q) / Hinv_jj`` is spread over the
    later columns by row ``j`` of ``Hinv``.

    One function on purpose: it is ``sparsify_weight``'s loop, batched, line for line.
    """
    weight = weights.to(torch.float32).clone()
    hessian = hessians.to(device=weight.device, dtype=torch.float32).clone()
    columns = weight.shape[-1]
    diagonal = hessian.diagonal(dim1=-2, dim2=-1)
    dead = diagonal == 0
    diagonal[dead] = 1
    weight.masked_fill_(dead.unsqueeze(1), 0)
    diagonal.add_(dampening_frac * diagonal.mean(dim=-1, keepdim=True))
    factor, failed = torch.linalg.cholesky_ex(hessian)
    hessian_inverse, failed_inverse = torch.linalg.cholesky_ex(
        torch.cholesky_inverse(factor), upper=True
    )
    failed = (failed != 0) | (failed_inverse != 0)
    if failed.any():  # sparsify_weight's fallback for a Hessian it cannot invert
        hessian_inverse[failed] = torch.eye(columns, dtype=weight.dtype, device=weight.device)
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        block = weight[:, :, i1:i2].clone()
        pruned = torch.zeros_like(block)
        errors = torch.zeros_like(block)
        block_inverse = hessian_inverse[:, i1:i2, i1:i2]
        block_diagonal = block_inverse.diagonal(dim1=-2, dim2=-1).unsqueeze(1)
        if prune_n == 0:
            saliency = (block**2 / block_diagonal**2).flatten(1)
            threshold = saliency.sort(dim=1)[0][:, int(saliency.shape[1] * sparsity)]
            mask = (saliency <= threshold.unsqueeze(1)).reshape(block.shape)
        else:
            mask = torch.zeros_like(block, dtype=torch.bool)
        for i in range(i2 - i1):
            column = block[:, :, i]
            if prune_n != 0 and i % prune_m == 0:
                saliency = (
                    block[:, :, i : i + prune_m] ** 2 / block_diagonal[:, :, i : i + prune_m] ** 2
                )
                mask.scatter_(2, i + saliency.topk(prune_n, dim=2, largest=False)[1], True)
            kept = column.masked_fill(mask[:, :, i], 0)
            pruned[:, :, i] = kept
            error = (column - kept) / block_inverse[:, i, i].unsqueeze(1)
            block[:, :, i:] -= error.unsqueeze(2) * block_inverse[:, i, i:].unsqueeze(1)
            errors[:, :, i] = error
        weight[:, :, i1:i2] = pruned
        weight[:, :, i2:] -= errors @ hessian_inverse[:, i1:i2, i2:]
    return weight
