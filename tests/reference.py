"""Slow reference implementations written straight from the paper's equations.

Everything here loops over pairs, neurons and channels in float64 so that it reads like
the paper's pseudocode (Appendix "Pseudocode"); the package's vectorised code is tested
against it.
"""

from __future__ import annotations

import math

import torch


def loop_differences(x, perms):
    """dX[:, k*s + l] = x_l - x_{pi_k(l)}, one pair at a time (paper Section 3.1)."""
    s, m = x.shape
    out = torch.empty(len(perms) * s, m, dtype=torch.float64)
    for k, perm in enumerate(perms):
        for ell in range(s):
            out[k * s + ell] = x[ell].double() - x[int(perm[ell])].double()
    return out


def loop_channel_norms(batches):
    """mean over sequences of ||X_j||_2^2, from scratch in float64."""
    sequences = [seq for batch in batches for seq in batch]
    total = torch.zeros(sequences[0].shape[-1], dtype=torch.float64)
    for seq in sequences:
        for j in range(seq.shape[-1]):
            total[j] += sum(float(v) ** 2 for v in seq[:, j].double())
    return total / len(sequences)


def loop_neuronwise(weight, differences, pair_fraction):
    """Wisp+ pseudocode (paper Appendix), one neuron and one pair at a time."""
    weight, differences = weight.double(), differences.double()
    s = differences.shape[0]
    k = max(1, round(pair_fraction * s))
    distances = [math.sqrt(sum(float(v) ** 2 for v in differences[ell])) for ell in range(s)]
    out = torch.zeros(weight.shape, dtype=torch.float64)
    for i in range(weight.shape[0]):
        r = [
            (abs(float(weight[i] @ differences[ell])) / distances[ell], ell)
            for ell in range(s)
            if distances[ell] > 0
        ]
        chosen = [ell for _, ell in sorted(r, reverse=True)[:k]]
        for j in range(weight.shape[1]):
            out[i, j] = sum(abs(float(differences[ell, j])) for ell in chosen) / len(chosen)
    return out


def loop_hessian(sequences):
    """sum over tokens of x x^T (float64)."""
    m = sequences[0].shape[-1]
    out = torch.zeros(m, m, dtype=torch.float64)
    for seq in sequences:
        for x in seq.double():
            out += torch.outer(x, x)
    return out


def loop_regularized_hessian(hessian, difference_hessian, gamma):
    """H~ = gamma H + (1 - gamma) (mu / mu_Delta) H_Delta, mu = tr(H) / m."""
    m = hessian.shape[0]
    mu = sum(float(hessian[j, j]) for j in range(m)) / m
    mu_delta = sum(float(difference_hessian[j, j]) for j in range(m)) / m
    return gamma * hessian + (1 - gamma) * (mu / mu_delta) * difference_hessian


def loop_regularized_norms(channel_norms, difference, gamma):
    """gamma ||X_j||^2 + (1 - gamma) (mu / mu_Delta) D, entry by entry; mu and mu_Delta
    are the plain means of ||X_j||^2 and of D (a vector, or Wisp+'s n x m a^2)."""
    plain = [float(v) for v in channel_norms.double()]
    entries = difference.double()
    flat = [float(v) for v in entries.reshape(-1)]
    mu, mu_delta = sum(plain) / len(plain), sum(flat) / len(flat)
    out = torch.zeros(entries.shape, dtype=torch.float64)
    for index in range(len(flat)):
        j = index % len(plain)
        out.view(-1)[index] = gamma * plain[j] + (1 - gamma) * (mu / mu_delta) * flat[index]
    return out


def loop_ria(weight, channel_scale, exponent=0.5):
    """(|W_ij| / sum_i |W_ij| + |W_ij| / sum_j |W_ij|) * c^a, entry by entry."""
    weight = weight.double().abs()
    n, m = weight.shape
    column_sums = [sum(float(weight[i, j]) for i in range(n)) for j in range(m)]
    row_sums = [sum(float(weight[i, j]) for j in range(m)) for i in range(n)]
    out = torch.zeros(n, m, dtype=torch.float64)
    for i in range(n):
        for j in range(m):
            c = channel_scale[j] if channel_scale.dim() == 1 else channel_scale[i, j]
            w = float(weight[i, j])
            out[i, j] = (w / column_sums[j] + w / row_sums[i]) * float(c) ** exponent
    return out


def loop_mapping_difficulty(weight, differences):
    """MD_i = mean_l (|dy_il| / median_l |dy_il|) / (||dX_l|| / max_l ||dX_l||)."""
    weight, differences = weight.double(), differences.double()
    pairs = [d for d in differences if float(d.norm()) > 0]
    norms = [float(d.norm()) for d in pairs]
    out = []
    for w in weight:
        dy = sorted(abs(float(w @ d)) for d in pairs)
        median = (dy[(len(dy) - 1) // 2] + dy[len(dy) // 2]) / 2
        ratios = [
            abs(float(w @ d)) / median / (norm / max(norms))
            for d, norm in zip(pairs, norms, strict=True)
        ]
        out.append(sum(ratios) / len(ratios))
    return torch.tensor(out, dtype=torch.float64)
