"""Choosing gamma per module (``gamma: auto``), as pure torch functions.

The paper fixes ``gamma = 0.01`` (tuned on 7B+ models) and leaves "optimizing gamma per
model or per layer" open.  At small scale that default loses to SparseGPT
(benchmarks/results), so
``gamma: auto`` picks gamma per difference module from a few candidates by what the
pruned module does to **held-out** calibration sequences:

* calibration sequence ``i`` (by global index, so the choice does not depend on batch
  size or ranks) belongs to fold ``i % holdout_every``; ``gamma_folds`` of the folds are
  measured (``held_out_fold``), the last one first;
* for each measured fold, each candidate gamma prunes the module with the statistics of
  every other sequence, and its error is measured on the fold's sequences: with one fold,
  every ``holdout_every``-th sequence is held out once; with all of them, k-fold
  cross-validation, where every sequence is measured once;
* the measured sequences keep the held-out token budget of one fold: with ``f`` folds
  measured, every ``f``-th token of each (``held_out_tokens``), so that more folds buy
  more independent sequences for the same error-measurement cost;
* the held-out sequences then join the statistics for the final solve with the chosen
  gamma.

The error is what the rest of the network sees.  For a gated MLP's gate and up
projections (which share their input, their ``H`` and ``H_Delta``, and so one gamma), it
is the MLP block's output error through the SiLU/GELU gating and the dense down
projection, ``e_t = W_down (act(G x_t) * U x_t - act(G^ x_t) * U^ x_t)``.  The gating is
where the difference criteria's argument lives (keeping neurons able to tell inputs
apart), and where a plain reconstruction error of ``G`` alone cannot see the interaction
with ``U``.  Any other module gets its own output error ``e_t = (W - W^) x_t``.  A
sequence's error is ``mean_t ||e_t||^2 / ||y_t||^2`` against the dense output ``y_t``
(``gamma_criterion: relative``) or ``sum_t ||e_t||^2`` (``absolute``): see
``sequence_error``.

The largest candidate is the reference: gamma = 1 is the baseline (SparseGPT / Wanda).
A few held-out sequences measure the other candidates noisily, and a layer that leaves
the baseline on noise makes the whole model worse than the baseline (benchmarks/results).
So a candidate displaces the reference only on evidence: its mean per-sequence error,
over every measured sequence of every fold, must be lower by more than
``gamma_evidence`` standard errors of the paired per-sequence difference (default 2, a
one-sided test at about 2.5 % for normal differences); the eligible candidate of least
error wins.  ``gamma_evidence: 0`` is the plain least-error rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

__all__ = [
    "WHISPER_GAMMA_CANDIDATES",
    "WISP_GAMMA_CANDIDATES",
    "choose_gamma",
    "select_gamma",
    "sequence_error",
    "gated_mlp_errors",
    "held_out_fold",
    "held_out_tokens",
    "output_errors",
    "paired_means",
    "paired_sums",
]

WHISPER_GAMMA_CANDIDATES = (0.01, 0.1, 0.3, 1.0)
"""The paper's default, the small-scale value that reached SparseGPT's parity, a middle
point, and SparseGPT itself."""
WISP_GAMMA_CANDIDATES = (0.0, 0.1, 0.3, 1.0)
"""Wisp itself, two mixtures, and Wanda itself."""


def held_out_fold(sequence_index: int, holdout_every: int, folds: int = 1) -> int | None:
    """The measured fold of global calibration sequence ``sequence_index``, or None if
    its fold is not measured: sequence ``i`` is in fold ``i % holdout_every``, and the
    last ``folds`` folds are measured (with ``folds = 1``, every ``holdout_every``-th
    sequence, starting with index ``holdout_every - 1``)."""
    fold = sequence_index % holdout_every
    return fold if fold >= holdout_every - folds else None


def held_out_tokens(
    sequence: torch.Tensor, sequence_index: int, holdout_every: int, folds: int = 1
) -> torch.Tensor:
    """The tokens of a held-out ``sequence`` (``[tokens, m]``) whose error is measured:
    every ``folds``-th, from an offset that cycles with the sequence's rank in its fold,
    so that ``folds`` measured folds cost what one fold of whole sequences does."""
    return sequence[(sequence_index // holdout_every) % folds :: folds]


def sequence_error(error: torch.Tensor, dense: torch.Tensor, criterion: str) -> torch.Tensor:
    """One held-out sequence's error from its per-token output errors ``error`` and the
    dense outputs ``dense`` (both ``[tokens, d]``), in float64:

    * ``"absolute"``: ``sum_t ||e_t||^2``;
    * ``"relative"``: ``mean_t ||e_t||^2 / ||y_t||^2``, each token's error against the
      size of the output it perturbs.  A few massive-activation tokens (attention sinks)
      can carry almost all of a layer's squared error while their huge hidden states
      hardly notice it; the relative error does not let them decide (benchmarks/results).
    """
    squared = error.square().sum(dim=-1, dtype=torch.float64)
    if criterion == "absolute":
        return squared.sum()
    if criterion != "relative":
        raise ValueError(f"criterion must be 'relative' or 'absolute', got {criterion!r}")
    size = dense.square().sum(dim=-1, dtype=torch.float64)
    return (squared / size.clamp_min(torch.finfo(torch.float64).tiny)).mean()


@torch.no_grad()
def output_errors(
    inputs: Iterable[torch.Tensor],
    weight: torch.Tensor,
    candidates: list[torch.Tensor],
    criterion: str = "relative",
) -> torch.Tensor:
    """``[candidates, sequences]``: ``sequence_error`` of ``(W - W^) x_t`` against
    ``W x_t`` over the tokens of each sequence of ``inputs`` (each ``[tokens, m]``) for
    each pruned weight ``W^`` in ``candidates``; float32, summed in float64."""
    weight = weight.float()
    changes = [(weight - pruned.float()).t() for pruned in candidates]
    errors = []
    for x in inputs:
        x = x.to(device=weight.device, dtype=torch.float32)
        dense = x @ weight.t()
        errors.append([sequence_error(x @ change, dense, criterion) for change in changes])
    return _per_sequence(errors, len(candidates))


@torch.no_grad()
def gated_mlp_errors(
    inputs: Iterable[torch.Tensor],
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    candidates: list[tuple[torch.Tensor, torch.Tensor]],
    criterion: str = "relative",
) -> torch.Tensor:
    """``[candidates, sequences]``: ``sequence_error`` of a gated MLP block's output error
    ``W_down (act(G x_t) * (U x_t) - act(G^ x_t) * (U^ x_t))`` against its dense output
    over the tokens of each sequence of ``inputs`` (each ``[tokens, m]``) for each pruned
    ``(G^, U^)`` in ``candidates``, with the dense down projection; the dense block is
    computed once per sequence. float32, summed in float64."""
    gate, up, down = gate.float(), up.float(), down.float()
    candidates = [(pruned_gate.float(), pruned_up.float()) for pruned_gate, pruned_up in candidates]
    errors = []
    for x in inputs:
        x = x.to(device=gate.device, dtype=torch.float32)
        hidden = activation(F.linear(x, gate)) * F.linear(x, up)
        dense = F.linear(hidden, down)
        row = []
        for pruned_gate, pruned_up in candidates:
            pruned = activation(F.linear(x, pruned_gate)) * F.linear(x, pruned_up)
            row.append(sequence_error(F.linear(hidden - pruned, down), dense, criterion))
        errors.append(row)
    return _per_sequence(errors, len(candidates))


def _per_sequence(errors: list[list[torch.Tensor]], candidates: int) -> torch.Tensor:
    """``[candidates, sequences]`` float64 on the CPU from one row per sequence."""
    if not errors:
        return torch.zeros(candidates, 0, dtype=torch.float64)
    return torch.stack([torch.stack(row) for row in errors], dim=1).cpu()


def paired_sums(errors: torch.Tensor, reference: int) -> torch.Tensor:
    """``[candidates, 3]``: per candidate, the sum of its per-sequence held-out errors
    (``errors`` is ``[candidates, sequences]``), the sum of squares of its per-sequence
    difference to candidate ``reference``, and the number of sequences. Sums, so that
    adding them over ranks gives what one process would have (``paired_means``)."""
    differences = errors - errors[reference]
    count = torch.full((errors.shape[0],), float(errors.shape[1]), dtype=torch.float64)
    return torch.stack([errors.sum(1), differences.square().sum(1), count], dim=1)


def paired_means(sums: torch.Tensor, reference: int) -> tuple[list[float], list[float]]:
    """From ``paired_sums`` (summed over ranks): each candidate's mean held-out error
    per sequence, and the standard error of the mean of its paired per-sequence
    difference to candidate ``reference`` (0 for the reference itself; infinite on fewer
    than two sequences)."""
    count = float(sums[reference, 2])
    means = sums[:, 0] / max(count, 1.0)
    if count < 2:
        standard_errors = torch.full_like(means, float("inf"))
    else:
        mean_difference = means - means[reference]
        variance = (sums[:, 1] / count - mean_difference.square()) * count / (count - 1)
        standard_errors = (variance.clamp(min=0) / count).sqrt()
    standard_errors[reference] = 0.0
    return means.tolist(), standard_errors.tolist()


def choose_gamma(
    errors: dict[float, float],
    standard_errors: dict[float, float] | None = None,
    evidence: float = 0.0,
) -> float:
    """The chosen candidate: the reference is the largest gamma (the one nearest the
    baseline, which gamma = 1 is). Another candidate is eligible when its mean held-out
    error is below the reference's by more than ``evidence`` standard errors of the
    paired per-sequence difference (``standard_errors``; with ``evidence = 0``, by
    anything). The eligible candidate of least error wins; a tie goes to the larger
    gamma. Deterministic for given errors."""
    if not errors:
        raise ValueError("no gamma candidate to choose from")
    reference = max(errors)
    eligible = [reference]
    for gamma, error in errors.items():
        gain = errors[reference] - error
        margin = evidence * standard_errors[gamma] if evidence > 0 else 0.0
        if gamma != reference and gain > 0 and gain > margin:
            eligible.append(gamma)
    return min(eligible, key=lambda gamma: (errors[gamma], -gamma))


def select_gamma(
    candidates: Iterable[float],
    fold_errors: Iterable[torch.Tensor],
    evidence: float = 0.0,
    reduce: Callable[[torch.Tensor], torch.Tensor] = lambda sums: sums,
) -> tuple[float, dict[float, float], dict[float, float], list[float]]:
    """``(chosen gamma, {candidate: mean held-out error per sequence}, {candidate:
    standard error of its paired difference to the largest candidate}, [the gamma each
    fold alone would choose])`` from ``fold_errors``: per measured fold, each candidate's
    per-sequence held-out errors ``[candidates, sequences]`` (this rank's). The choice
    pools every fold's sequences; ``reduce`` sums ``paired_sums`` over ranks
    (``choose_gamma`` decides). The per-fold choices tell how much the held-out split
    alone moves the choice."""
    candidates = list(candidates)
    reference = candidates.index(max(candidates))

    def choose(sums):
        means, standard_errors = paired_means(reduce(sums), reference)
        by_gamma = dict(zip(candidates, means, strict=True))
        spread = dict(zip(candidates, standard_errors, strict=True))
        return choose_gamma(by_gamma, spread, evidence), by_gamma, spread

    per_fold = [paired_sums(errors, reference) for errors in fold_errors]
    fold_choices = [choose(sums)[0] for sums in per_fold]
    return (*choose(sum(per_fold)), fold_choices)
