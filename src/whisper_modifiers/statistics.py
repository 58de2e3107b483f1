"""Calibration statistics of the Sparsity Whisperer, as pure torch functions.

Notation follows the paper (Section 3): a linear layer ``W`` is ``n x m`` (``n`` output
neurons, ``m`` input channels).  The functions here take activations with tokens in
rows, the way a forward hook sees them (``[tokens, m]``, or ``[sequences, tokens, m]``);
the paper's ``X`` is the transpose.  Statistics are computed in float32 whatever the
input dtype and summed over sequences in float64, one sequence at a time, so that they do
not depend on batch size or ranks; nothing here imports llmcompressor.

* ``pairwise_differences`` -- the sampled pairs ``dX = X - X_pi`` of Section 3.1, formed
  within one calibration sequence (Section 3.4).
* ``add_sequence_channel_norms`` -- the sum over sequences of ``||X_j||_2^2`` (Wanda's
  statistic on ``X``; Wisp's on ``dX``), in float64.
* ``add_sequence_grams`` -- the sum over sequences of ``X X^T`` (SparseGPT's Hessian ``H``
  on ``X``; the difference Hessian ``H_Delta`` on ``dX``), in float64.
* ``mean_over_sequences`` -- such a sum as the float32 mean the solvers take.
* ``neuronwise_difference`` -- Wisp+'s ``a_ij`` (Section 3.2).
* ``regularized_difference_hessian`` -- Whisper's ``H~`` (Section 3.3).
* ``regularized_difference_norms`` -- its diagonal, the gamma-regularised Wisp / Wisp+
  statistic.
* ``nearest_neighbour_differences`` -- the nearest-neighbour pairing of the appendix
  "Sampling approach details".
* ``scaled_sequence_means`` -- ``sqrt(s) x_bar`` per sequence, from which the centered
  statistics of the appendix "Centering" follow: ``X_c X_c^T = X X^T - s x_bar x_bar^T``.
* ``centered`` -- the centered statistic from those means.
* ``mapping_difficulty`` -- the per-neuron diagnostic of the appendix "Mapping
  difficulty definition".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

STATISTICS_DTYPE = torch.float32
SUM_DTYPE = torch.float64  # sums over sequences: exact, hence order-independent

__all__ = [
    "STATISTICS_DTYPE",
    "SUM_DTYPE",
    "add_sequence_channel_norms",
    "add_sequence_grams",
    "mapping_difficulty",
    "mean_over_sequences",
    "num_sequences",
    "nearest_neighbour_differences",
    "scaled_sequence_means",
    "neuronwise_difference",
    "num_selected_pairs",
    "pair_permutations",
    "pairwise_differences",
    "regularized_difference_hessian",
    "regularized_difference_norms",
]


def pair_permutations(seq_len: int, num_permutations: int, seed: Sequence[int]) -> torch.Tensor:
    """Seeded random permutations ``pi`` of the ``seq_len`` positions of one sequence.

    ``seed`` is a sequence of integers (e.g. the user's seed, a module id and the index
    of the calibration sequence); it is mixed by numpy's ``SeedSequence`` so that
    neighbouring seeds give unrelated permutations.  Returns a CPU ``LongTensor`` of
    shape ``[num_permutations, seq_len]``; the same seed always gives the same rows.
    """
    if seq_len < 2:
        raise ValueError(
            f"a calibration sequence of length {seq_len} has no pair of distinct tokens; "
            "pairwise differences need sequences of at least 2 tokens"
        )
    if num_permutations < 1:
        raise ValueError(f"num_permutations must be >= 1, got {num_permutations}")
    state = np.random.SeedSequence([int(s) for s in seed]).generate_state(2, np.uint32)
    generator = torch.Generator(device="cpu")
    generator.manual_seed((int(state[0]) << 31) ^ int(state[1]))
    return torch.stack(
        [torch.randperm(seq_len, generator=generator) for _ in range(num_permutations)]
    )


def pairwise_differences(x: torch.Tensor, permutations: torch.Tensor) -> torch.Tensor:
    """``dX = X - X_pi`` for one sequence, in float32 (paper Section 3.1).

    :param x: activations of one sequence, ``[seq_len, m]`` (tokens in rows).
    :param permutations: ``[num_permutations, seq_len]`` from ``pair_permutations``.
    :return: ``[num_permutations * seq_len, m]``; row ``k * seq_len + l`` is
        ``x_l - x_{pi_k(l)}``.
    """
    if x.dim() != 2 or permutations.dim() != 2 or permutations.shape[1] != x.shape[0]:
        raise ValueError(
            f"expected x [seq_len, m] and permutations [N, seq_len], got "
            f"{tuple(x.shape)} and {tuple(permutations.shape)}"
        )
    x = x.to(STATISTICS_DTYPE)
    index = permutations.to(x.device).reshape(-1)
    return x.repeat(permutations.shape[0], 1) - x.index_select(0, index)


def _as_sequences(x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """View activations as ``[sequences, tokens, m]`` (a 2-d input is one sequence); a
    list of ``[tokens, m]`` (sequences of different lengths, an MoE expert's) as it is."""
    if isinstance(x, list):
        return x
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() != 3:
        raise ValueError(f"expected activations [tokens, m] or [b, tokens, m], got {x.shape}")
    return x


def add_sequence_channel_norms(total: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``total + sum_s ||X_s,j||_2^2`` over the sequences ``s`` of ``x`` (Wanda's statistic on
    ``X``, Wisp's on ``dX``), in float64: each sequence's squared norms are computed on
    their own, so the sum does not depend on how sequences are batched or split across
    ranks (see ``add_sequence_grams``). ``mean_over_sequences(total, count)`` is the
    running mean llmcompressor's Wanda keeps (its ``row_scalars``).

    :param total: ``[m]`` float64 sum so far, or ``None`` to start.
    :param x: ``[b, tokens, m]`` (each row one sequence) or ``[tokens, m]``.
    """
    for sequence in _as_sequences(x):
        norms = sequence.to(SUM_DTYPE).square().sum(dim=0)
        total = norms if total is None else total.add_(norms.to(total.device))
    return total


def add_sequence_grams(total: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``total + sum_s X_s X_s^T`` over the sequences ``s`` of ``x``, in float64 (SparseGPT's
    ``H`` on ``X``, the difference Hessian ``H_Delta`` on ``dX``, paper Section 3.3).

    Each sequence's product is one float32 GEMM of that sequence alone (a fresh copy, so
    its memory layout never depends on the batch it came in) and is added in float64. A
    float64 sum of float32 terms is exact unless the terms span more than ~2^29 in
    magnitude, so it is the same in any order: the statistic, and the masks, do not depend
    on the batch size or on how the sequences are split over ranks.
    ``mean_over_sequences(total, count, 2)`` is SparseGPT's ``H = (2 / N) X X^T``.

    :param total: ``[m, m]`` float64 sum so far, or ``None`` to start.
    """
    for sequence in _as_sequences(x):
        sequence = sequence.to(STATISTICS_DTYPE, copy=True)
        product = sequence.t() @ sequence
        total = product.to(SUM_DTYPE) if total is None else total.add_(product.to(total.device))
    return total


def mean_over_sequences(total: torch.Tensor, count: int, scale: float = 1.0) -> torch.Tensor:
    """``scale * total / count`` in float32: a statistic summed over ``count`` sequences
    (``add_sequence_*``) as the solvers take it (``scale`` 2 for SparseGPT's Hessian)."""
    if count < 1:
        raise ValueError(f"a statistic over {count} sequences has no mean")
    return (total * (scale / count)).to(STATISTICS_DTYPE)


def num_sequences(x: torch.Tensor) -> int:
    """How many sequences a hook's input holds (``[b, tokens, m]``, one ``[tokens, m]``, or
    a list of ``[tokens, m]``)."""
    return len(_as_sequences(x))


def num_selected_pairs(num_pairs: int, pair_fraction: float) -> int:
    """Wisp+'s ``K = max(1, round(pair_fraction * s))`` for ``s`` sampled pairs."""
    return max(1, round(pair_fraction * num_pairs))


def neuronwise_difference(
    weight: torch.Tensor,
    differences: torch.Tensor,
    pair_fraction: float = 0.005,
    neuron_chunk: int = 4096,
) -> torch.Tensor | None:
    """Wisp+'s neuronwise difference statistic ``a`` for one sequence (Section 3.2).

    For neuron ``i`` and pair ``l``: ``r_il = |w_i . dX_l| / ||dX_l||_2`` (pairs with zero
    distance are never selected), ``P_i`` = the ``K`` pairs of largest ``r_il`` with
    ``K = max(1, round(pair_fraction * s))`` (all of the pairs of nonzero distance where
    there are fewer), and ``a_ij = (1 / |P_i|) sum_{l in P_i} |dX_jl|`` (an l1 mean).  The
    saliency is ``S_ij = |W_ij| * a_ij``.

    The selection is applied as a dense ``[chunk, s]`` matrix with ``1 / |P_i|`` at the
    selected pairs, multiplied by ``|dX|``: one GEMM per chunk of neurons, so memory stays
    ``O(chunk * (s + m))`` and no ``n x K x m`` tensor is ever formed. Nothing is read
    back to the host (no data-dependent shape): a sequence on a GPU does not wait for it.

    :param weight: ``[n, m]`` layer weight (any dtype; used in float32).
    :param differences: ``[s, m]`` pairwise differences of one sequence.
    :return: ``[n, m]`` float32; zeros where every pair has zero distance (the sequence
        carries no difference information).
    """
    differences = differences.to(STATISTICS_DTYPE)
    distances = torch.linalg.vector_norm(differences, dim=1)
    valid = distances > 0
    k = num_selected_pairs(differences.shape[0], pair_fraction)
    abs_differences = differences.abs()
    weight = weight.to(device=differences.device, dtype=STATISTICS_DTYPE)

    statistic = torch.empty_like(weight)
    for start in range(0, weight.shape[0], neuron_chunk):
        rows = weight[start : start + neuron_chunk]
        separation = (rows @ differences.t()).abs_() / distances  # r, [chunk, s]
        separation.masked_fill_(~valid, -torch.inf)  # after the valid pairs, if picked
        selected = separation.topk(k, dim=1).indices
        chosen = torch.zeros_like(separation).scatter_(1, selected, 1.0) * valid
        selection = chosen / chosen.sum(dim=1, keepdim=True).clamp_min(1.0)
        statistic[start : start + neuron_chunk] = selection @ abs_differences
    return statistic


def regularized_difference_hessian(
    hessian: torch.Tensor, difference_hessian: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Whisper's ``H~ = gamma H + (1 - gamma) (mu / mu_Delta) H_Delta`` (Section 3.3).

    ``mu = tr(H) / m`` and ``mu_Delta = tr(H_Delta) / m``, so the difference Hessian is
    rescaled to the average diagonal of ``H`` before mixing; ``tr(H~) = tr(H)``.
    ``gamma = 1`` returns ``H`` itself (SparseGPT); ``gamma = 0`` the rescaled
    ``H_Delta`` alone.
    """
    m = hessian.shape[0]
    return _regularized_mixture(
        hessian,
        difference_hessian,
        gamma,
        torch.trace(hessian) / m,
        torch.trace(difference_hessian) / m,
        "difference Hessian",
    )


def regularized_difference_norms(
    channel_norms: torch.Tensor, difference_norms: torch.Tensor, gamma: float
) -> torch.Tensor:
    """The diagonal of Whisper's mixture, for the no-update methods:
    ``gamma ||X_j||^2 + (1 - gamma) (mu / mu_Delta) D``, with ``mu`` the mean of
    ``||X_j||^2`` and ``mu_Delta`` the mean of ``D``.

    ``D`` is Wisp's ``||dX_j||^2`` (``[m]``; the result is the diagonal of
    ``regularized_difference_hessian`` on the same scale), or Wisp+'s squared neuronwise
    statistic ``a_ij^2`` (``[n, m]``; ``mu_Delta`` is then its mean over the layer, the
    analogue of ``tr(H_Delta) / m``).  The saliency is ``|W_ij|`` times the square root.
    ``gamma = 1`` returns ``channel_norms`` itself (Wanda).
    """
    return _regularized_mixture(
        channel_norms,
        difference_norms,
        gamma,
        channel_norms.mean(),
        difference_norms.mean(),
        "difference statistic",
    )


def _regularized_mixture(plain, difference, gamma: float, mu, mu_delta, what: str):
    """``gamma plain + (1 - gamma) (mu / mu_Delta) difference``; ``plain`` at gamma 1."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    if gamma == 1.0:
        return plain
    if not mu_delta > 0:
        raise ValueError(
            f"the {what} is zero (all sampled pairs have identical inputs); the "
            "difference criteria need calibration sequences whose tokens differ"
        )
    return gamma * plain + (1.0 - gamma) * (mu / mu_delta) * difference


def nearest_neighbour_differences(x: torch.Tensor) -> torch.Tensor:
    """``dX_NN = [x_l - x_n(l)]`` with ``n(l) = argmin_{j != l} ||x_l - x_j||_2`` within
    one sequence ``[seq_len, m]`` (ties go to the lowest index); float32 ``[seq_len, m]``.
    Costs one ``s x s`` distance matrix per sequence."""
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"expected one sequence [seq_len >= 2, m], got {tuple(x.shape)}")
    x = x.to(STATISTICS_DTYPE)
    squared_norms = (x * x).sum(dim=1)
    distances = squared_norms.unsqueeze(1) + squared_norms.unsqueeze(0) - 2 * (x @ x.t())
    distances.fill_diagonal_(float("inf"))
    return x - x[distances.argmin(dim=1)]


def scaled_sequence_means(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(s) * x_bar`` of each sequence, as ``[b, 1, m]`` float32.

    Fed to ``add_sequence_channel_norms`` / ``add_sequence_grams`` it sums
    ``s x_bar_j^2`` / ``s x_bar x_bar^T`` on the same scale as the uncentered
    statistics, so the centered ones are a subtraction (paper appendix "Centering"):
    ``||X_c,j||^2 = ||X_j||^2 - s x_bar_j^2`` and ``H_c = H - s x_bar x_bar^T``.
    """
    x = _as_sequences(x).to(STATISTICS_DTYPE)
    return x.mean(dim=1, keepdim=True) * math.sqrt(x.shape[1])


def centered(uncentered: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """The centered statistic of the appendix "Centering": ``X_c X_c^T = X X^T - s x_bar
    x_bar^T`` (``uncentered`` less the mean of ``scaled_sequence_means``' Grams), or its
    diagonal ``||X_c,j||^2``; diagonal entries clamped at 0 (rounding)."""
    result = uncentered - correction.to(uncentered.device)
    if result.dim() == 1:
        return result.clamp_min(0)
    result.diagonal().clamp_(min=0)
    return result


def mapping_difficulty(weight: torch.Tensor, differences: torch.Tensor) -> torch.Tensor:
    """Per-neuron mapping difficulty (Sawmya et al.; paper appendix "Mapping difficulty
    definition") over the pairs ``differences`` (``[s, m]``):

    ``MD_i = mean_l (|dy_il| / N_y,i) / (||dX_l|| / N_x)``, ``N_x = max_l ||dX_l||``,
    ``N_y,i = median_l |dy_il|``.  Pairs of zero distance are skipped.  Returns ``[n]``
    float32.
    """
    differences = differences.to(STATISTICS_DTYPE)
    distances = torch.linalg.vector_norm(differences, dim=1)
    valid = distances > 0
    differences, distances = differences[valid], distances[valid]
    if distances.numel() == 0:
        raise ValueError("every pair has zero input distance; mapping difficulty is undefined")
    separations = (weight.to(differences.device, STATISTICS_DTYPE) @ differences.t()).abs()
    ordered = separations.sort(dim=1).values  # median of an even count: mean of the middle two
    count = ordered.shape[1]
    medians = (ordered[:, (count - 1) // 2] + ordered[:, count // 2]).unsqueeze(1) / 2
    medians = torch.where(medians > 0, medians, torch.ones_like(medians))
    return ((separations / medians) / (distances / distances.max())).mean(dim=1)
