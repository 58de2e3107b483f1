"""Pruning solvers, as pure torch functions.

* ``prune_mask`` / ``prune_by_score`` -- the no-update solver of magnitude, Wanda, Wisp,
  Wisp+ and RIA: keep the highest scores of each output row (Wanda's comparison group),
  of the whole layer (RIA's reference default), or of each group of ``M`` consecutive
  inputs (N:M).
* ``wanda_scores`` / ``ria_scores`` -- the saliencies over a channel statistic.
* ``alps_prune`` -- ALPS: ADMM on the ridge-regularised reconstruction objective, then
  conjugate gradient on the fixed support.
* The SparseGPT / OBS solver is llmcompressor's own ``sgpt_sparsify.sparsify_weight``;
  Whisper hands it ``H~`` in place of ``H``, so it is reused, not rewritten.
  ``sparsegpt_prune_batch`` runs the same steps on a batch of independent problems at
  once; ``gamma: auto`` uses it to prune gate and up at every candidate gamma in one
  loop over the columns (its tests hold it to ``sparsify_weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ALPSResult",
    "alps_prune",
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


@dataclass
class ALPSResult:
    weight: torch.Tensor
    iterations: int  # ADMM iterations run
    rho: float  # final penalty
    objective: float  # relative reconstruction error after the CG refinement


def _project(values: torch.Tensor, keep: int, prune_n: int, prune_m: int) -> torch.Tensor:
    """Euclidean projection onto the sparsity set: the mask of entries kept."""
    if prune_n:
        return ~prune_mask(values.abs(), 0.0, prune_n, prune_m)
    mask = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    mask[values.abs().reshape(-1).topk(keep).indices] = True
    return mask.reshape(values.shape)


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


def alps_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float,
    prune_n: int = 0,
    prune_m: int = 0,
    ridge_frac: float = 0.01,
    rho: float = 0.1,
    max_iter: int = 300,
    update_every: int = 3,
    min_iter: int = 30,
    support_tol: float = 3e-4,
    cg_iter: int = 10,
    cg_rtol: float = 1e-4,
) -> ALPSResult:
    """ALPS (Meng et al. 2024): minimise ``1/2 tr((W - V) H (W - V)^T) + lambda_2/2
    ||W - V||^2`` over ``V`` with the sparsity pattern, for ``H = X X^T`` (ALPS) or
    Whisper's ``H~`` (ALPS-Whisper).

    With ``lambda_2 = ridge_frac * mean(diag H)`` and ``D = sqrt(diag(H + lambda_2 I))``
    the problem is solved in normalised coordinates ``B = V D``, ``G = D^-1 (H +
    lambda_2 I) D^-1``.  ADMM splits ``B`` (unconstrained, ``B = (W G - Lambda + rho Z)
    (G + rho I)^-1`` through one eigendecomposition of ``G``) from ``Z`` (the projection
    of ``B + Lambda / rho`` onto the sparsity set); ``Lambda += rho (B - Z)``.  Every
    ``update_every`` iterations ``rho`` follows the reference schedule on the support
    change ``c`` (relative to the number of kept weights ``k``): x1.3 if ``c/k > 0.1``,
    x1.2 if ``> 0.005``, x1.1 if any change (or, before any increase, /5 and restart),
    stop if none after an increase; stop after ``min_iter`` iterations once
    ``c/k < support_tol``; ``rho <= 1e6``.  The support of the projected ``B`` is then
    fixed and the weights on it refined by ``cg_iter`` conjugate-gradient steps
    (relative residual ``cg_rtol``) on ``B G = W G``.

    ``prune_n``/``prune_m`` prune N of every M consecutive inputs of each row;
    unstructured sparsity keeps the largest ``round((1 - sparsity) n m)`` of the layer.

    One function on purpose: it follows the reference implementation's loop (set-up,
    ADMM with its rho schedule, conjugate-gradient refinement) step for step, so that the
    two can be read side by side.
    """
    dtype = weight.dtype
    w = weight.float()
    rows, columns = w.shape
    h = hessian.to(device=w.device, dtype=torch.float32).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h.diagonal().add_(ridge_frac * h.diagonal().mean())
    scale = h.diagonal().sqrt()
    g = h / scale.reshape(-1, 1) / scale.reshape(1, -1)
    w_scaled = w * scale
    target = w_scaled @ g  # W G: the right-hand side of the normal equations
    if prune_n:
        keep = rows * columns * (prune_m - prune_n) // prune_m  # weights kept
    else:
        keep = round((1 - sparsity) * rows * columns)
    eigenvalues, eigenvectors = torch.linalg.eigh(g.double())

    def inverse(penalty: float) -> torch.Tensor:
        return ((eigenvectors / (eigenvalues + penalty)) @ eigenvectors.T).float()

    def restart():
        return w_scaled.clone(), w_scaled * _project(w_scaled, keep, prune_n, prune_m)

    b, z = restart()
    z_start = z.clone()
    dual = torch.zeros_like(b)
    support = z != 0
    g_inverse = inverse(rho)
    increased = False
    iteration = 0
    for iteration in range(1, max_iter + 1):
        b = (target - dual + rho * z) @ g_inverse
        shifted = b + dual / rho
        z = shifted * _project(shifted, keep, prune_n, prune_m)
        dual += rho * (b - z)
        if iteration % update_every:
            continue
        new_support = z != 0
        change = int((new_support != support).sum())
        support = new_support
        if change / keep > 0.1:
            rho, increased = rho * 1.3, True
        elif change / keep > 0.005:
            rho, increased = rho * 1.2, True
        elif change > 0:
            if increased:
                rho *= 1.1
            else:
                rho /= 5
                b, z, dual = w_scaled.clone(), z_start.clone(), torch.zeros_like(b)
        elif increased:
            break
        else:
            rho /= 5
        rho = min(rho, 1e6)
        g_inverse = inverse(rho)
        if iteration >= min_iter and change / keep < support_tol:
            break

    mask = _project(b, keep, prune_n, prune_m)
    b = _conjugate_gradient(g, target, b * mask, mask, cg_iter, cg_rtol)
    difference = b - w_scaled
    objective = float(((difference @ g) * difference).sum() / ((w_scaled @ g) * w_scaled).sum())
    return ALPSResult((b / scale).to(dtype), iteration, rho, objective)


def _conjugate_gradient(g, target, start, mask, iterations, rtol):
    """Solve ``B G = target`` for ``B`` restricted to ``mask`` (one system per row)."""
    b = start
    residual = (target - b @ g) * mask
    direction = residual.clone()
    norm = (residual * residual).sum(dim=1)
    target_norm = target.norm(dim=1)
    for _ in range(iterations):
        if (norm.sqrt() <= rtol * target_norm).all():
            break
        curvature = direction @ g
        step = norm / (direction * curvature).sum(dim=1).clamp_min(1e-30)
        b = b + step.unsqueeze(1) * direction
        residual = (residual - step.unsqueeze(1) * curvature) * mask
        new_norm = (residual * residual).sum(dim=1)
        direction = residual + (new_norm / norm.clamp_min(1e-30)).unsqueeze(1) * direction
        norm = new_norm
    return b
