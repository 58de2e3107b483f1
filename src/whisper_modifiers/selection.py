"""Choosing gamma per module (``gamma: auto``), as pure torch functions.

The paper fixes ``gamma = 0.01`` (tuned on 7B+ models) and leaves "optimizing gamma per
model or per layer" open.  At small scale that default loses to SparseGPT (README), so
``gamma: auto`` picks gamma per difference module from a few candidates by what the
pruned module does to **held-out** calibration sequences:

* every ``holdout_every``-th calibration sequence (by global index, so the choice does
  not depend on batch size or ranks) is kept out of the statistics;
* each candidate gamma prunes the module with statistics of the other sequences;
* its error is measured on the held-out sequences, then those sequences join the
  statistics for the final solve with the chosen gamma.

The error is what the rest of the network sees.  For a gated MLP's gate and up
projections (which share their input, their ``H`` and ``H_Delta``, and so one gamma), it
is the MLP block's output error through the SiLU/GELU gating and the dense down
projection: ``sum_t ||W_down (act(G x_t) * U x_t - act(G^ x_t) * U^ x_t)||^2``.  The
gating is where the difference criteria's argument lives (keeping neurons able to tell
inputs apart), and where a plain reconstruction error of ``G`` alone cannot see the
interaction with ``U``.  Any other module gets its own output error
``sum_t ||(W - W^) x_t||^2``.  Candidate 1 is the baseline (SparseGPT / Wanda), so on
the held-out sequences the choice is never worse than the baseline at this module.
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
    "gated_mlp_errors",
    "is_held_out",
    "output_errors",
]

WHISPER_GAMMA_CANDIDATES = (0.01, 0.1, 0.3, 1.0)
"""The paper's default, the small-scale value that reached SparseGPT's parity, a middle
point, and SparseGPT itself."""
WISP_GAMMA_CANDIDATES = (0.0, 0.1, 0.3, 1.0)
"""Wisp itself, two mixtures, and Wanda itself."""


def is_held_out(sequence_index: int, holdout_every: int) -> bool:
    """Whether global calibration sequence ``sequence_index`` is held out:
    every ``holdout_every``-th one, starting with index ``holdout_every - 1``."""
    return sequence_index % holdout_every == holdout_every - 1


@torch.no_grad()
def output_errors(
    inputs: Iterable[torch.Tensor], weight: torch.Tensor, candidates: list[torch.Tensor]
) -> list[float]:
    """``sum_t ||(W - W^) x_t||_2^2`` over the tokens of ``inputs`` (each ``[tokens, m]``)
    for each pruned weight ``W^`` in ``candidates``; float32, summed in float64."""
    changes = [(weight.float() - pruned.float()).t() for pruned in candidates]
    totals = [0.0] * len(candidates)
    for x in inputs:
        x = x.to(device=weight.device, dtype=torch.float32)
        for index, change in enumerate(changes):
            totals[index] += float((x @ change).square().sum(dtype=torch.float64))
    return totals


@torch.no_grad()
def gated_mlp_errors(
    inputs: Iterable[torch.Tensor],
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    candidates: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[float]:
    """A gated MLP block's output error ``sum_t ||W_down (act(G x_t) * (U x_t) -
    act(G^ x_t) * (U^ x_t))||_2^2`` over the tokens of ``inputs`` (each ``[tokens, m]``)
    for each pruned ``(G^, U^)`` in ``candidates``, with the dense down projection; the
    dense block is computed once per sequence. float32, summed in float64."""
    gate, up, down = gate.float(), up.float(), down.float()
    candidates = [(pruned_gate.float(), pruned_up.float()) for pruned_gate, pruned_up in candidates]
    totals = [0.0] * len(candidates)
    for x in inputs:
        x = x.to(device=gate.device, dtype=torch.float32)
        dense = activation(F.linear(x, gate)) * F.linear(x, up)
        for index, (pruned_gate, pruned_up) in enumerate(candidates):
            pruned = activation(F.linear(x, pruned_gate)) * F.linear(x, pruned_up)
            totals[index] += float(F.linear(dense - pruned, down).square().sum(dtype=torch.float64))
    return totals


def choose_gamma(errors: dict[float, float]) -> float:
    """The candidate of least held-out error; a tie goes to the larger gamma (nearer the
    baseline). Deterministic for given errors."""
    if not errors:
        raise ValueError("no gamma candidate to choose from")
    return min(errors, key=lambda gamma: (errors[gamma], -gamma))


def select_gamma(
    candidates: Iterable[float],
    prune: Callable[[float], dict],
    errors: Callable[[list[dict]], list[float]],
) -> tuple[float, dict[float, float]]:
    """``(chosen gamma, {candidate: held-out error})``: ``prune(gamma)`` gives the pruned
    weights at a candidate, ``errors([pruned, ...])`` the held-out error of each."""
    candidates = list(candidates)
    measured = errors([prune(gamma) for gamma in candidates])
    by_gamma = dict(zip(candidates, measured, strict=True))
    return choose_gamma(by_gamma), by_gamma
