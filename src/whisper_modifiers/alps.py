"""ALPS (Meng et al. 2024), as a pure torch function: ADMM on the ridge-regularised
reconstruction objective, then conjugate gradient on the fixed support.

``alps_prune`` takes ``H = X X^T`` (ALPS) or Whisper's ``H~`` (ALPS-Whisper: Section 3.3's
``gamma H + (1 - gamma) (mu / mu_Delta) H_Delta``, ``statistics.regularized_difference_hessian``);
its projection onto an N:M sparsity set is ``solvers.prune_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from whisper_modifiers.solvers import prune_mask

__all__ = ["ALPSResult", "alps_prune"]


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
