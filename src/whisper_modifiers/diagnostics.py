"""Diagnostics of one layer: why (and where) the difference signal matters.

Works on the dense inputs of a Linear module captured on calibration sequences:

* ``mapping_difficulty`` (statistics) per neuron and ``wasserstein_to_normal`` -- the
  Wasserstein-1 distance of each neuron's standardised outputs to N(0, 1); the top 1 %
  are the layer's "Wasserstein neurons".
* ``saliencies`` -- Wanda's, Wisp's and Wisp+'s scores of the layer (paper Figure 2).
* ``prune_layer`` -- the layer pruned alone by a method, from the same pure statistics and
  solvers the modifiers use; ``difficulty_under_pruning`` tracks how much of the
  Wasserstein neurons' mapping difficulty survives as sparsity rises.
* ``gamma_sweep`` -- reconstruction error of ``WX`` and ``W dX`` and the R^2 of
  neuronwise output means as Whisper's gamma varies (paper appendix on gamma).
"""

from __future__ import annotations

import math
import zlib

import torch

from whisper_modifiers.methods import MAIN_METHODS
from whisper_modifiers.solvers import prune_by_score, wanda_scores
from whisper_modifiers.statistics import (
    STATISTICS_DTYPE,
    add_sequence_channel_norms,
    add_sequence_grams,
    mapping_difficulty,
    mean_over_sequences,
    neuronwise_difference,
    pair_permutations,
    pairwise_differences,
    regularized_difference_hessian,
)

__all__ = [
    "LAYER_METHODS",
    "capture_inputs",
    "difficulty_under_pruning",
    "gamma_sweep",
    "prune_layer",
    "saliencies",
    "sequence_pairs",
    "wasserstein_neurons",
    "wasserstein_to_normal",
]

LAYER_METHODS = MAIN_METHODS  # the paper's methods, by methods.py's names


@torch.no_grad()
def capture_inputs(model, module_name: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The inputs ``[seq_len, m]`` (float32) that ``module_name`` receives on each
    calibration sequence in the dense model."""
    captured: list[torch.Tensor] = []
    module = model.get_submodule(module_name)
    handle = module.register_forward_hook(
        lambda _m, args, _o: captured.append(args[0][0].detach().to(STATISTICS_DTYPE).cpu())
    )
    try:
        device = next(model.parameters()).device
        for ids in sequences:
            model(torch.tensor([ids], device=device))
    finally:
        handle.remove()
    return captured


def sequence_pairs(inputs: list[torch.Tensor], seed: int, name: str = "") -> list[torch.Tensor]:
    """One seeded permutation's differences per sequence (as the modifiers draw them)."""
    module_id = zlib.crc32(name.encode())
    return [
        pairwise_differences(x, pair_permutations(x.shape[0], 1, (seed, module_id, index)))
        for index, x in enumerate(inputs)
    ]


def wasserstein_to_normal(outputs: torch.Tensor) -> torch.Tensor:
    """W1 distance between each row's standardised empirical distribution and N(0, 1):
    ``mean_k |z_(k) - Phi^-1((k - 1/2) / s)|`` over the sorted standardised values."""
    outputs = outputs.to(STATISTICS_DTYPE)
    std = outputs.std(dim=1, keepdim=True).clamp_min(1e-12)
    z = ((outputs - outputs.mean(dim=1, keepdim=True)) / std).sort(dim=1).values
    s = z.shape[1]
    quantiles = (torch.arange(s, dtype=STATISTICS_DTYPE, device=z.device) + 0.5) / s
    normal = math.sqrt(2) * torch.erfinv(2 * quantiles - 1)
    return (z - normal).abs().mean(dim=1)


def wasserstein_neurons(distances: torch.Tensor, fraction: float = 0.01) -> torch.Tensor:
    """Indices of the ``fraction`` of neurons farthest from Gaussian (at least one)."""
    return distances.topk(max(1, round(fraction * distances.numel()))).indices


def _channel_norms(sequences: list[torch.Tensor]) -> torch.Tensor:
    total = None
    for x in sequences:
        total = add_sequence_channel_norms(total, x)
    return mean_over_sequences(total, len(sequences)).sqrt()


def _gram(sequences: list[torch.Tensor]) -> torch.Tensor:
    total = None
    for x in sequences:
        total = add_sequence_grams(total, x)
    return mean_over_sequences(total, len(sequences), 2.0)


def _neuronwise(weight, pairs, pair_fraction) -> torch.Tensor:
    return sum(neuronwise_difference(weight, d, pair_fraction) for d in pairs) / len(pairs)


def saliencies(
    weight: torch.Tensor, inputs: list[torch.Tensor], pairs: list[torch.Tensor], pair_fraction=0.005
) -> dict[str, torch.Tensor]:
    """Wanda's, Wisp's and Wisp+'s saliency matrices ``[n, m]`` of one layer."""
    return {
        "wanda": wanda_scores(weight, _channel_norms(inputs)),
        "wisp": wanda_scores(weight, _channel_norms(pairs)),
        "wisp_plus": wanda_scores(weight, _neuronwise(weight, pairs, pair_fraction)),
    }


def prune_layer(
    method: str,
    weight: torch.Tensor,
    inputs: list[torch.Tensor],
    pairs: list[torch.Tensor],
    sparsity: float,
    prune_n: int = 0,
    prune_m: int = 0,
    gamma: float = 0.01,
    dampening_frac: float = 0.01,
    pair_fraction: float = 0.005,
) -> torch.Tensor:
    """This layer pruned alone by ``method`` (one of ``LAYER_METHODS``)."""
    if method in ("sparsegpt", "whisper"):
        from llmcompressor.modifiers.pruning.sparsegpt.sgpt_sparsify import sparsify_weight

        hessian = _gram(inputs)
        if method == "whisper":
            hessian = regularized_difference_hessian(hessian, _gram(pairs), gamma)
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        layer.weight.data.copy_(weight)
        _, pruned = sparsify_weight(
            layer, {layer: hessian}, sparsity, prune_n, prune_m, 128, dampening_frac, False
        )
        return pruned.detach()
    if method == "magnitude":
        scores = weight.abs().float()
    elif method in ("wanda", "wisp", "wisp_plus"):
        scores = saliencies(weight, inputs, pairs, pair_fraction)[method]
    else:
        raise ValueError(f"method must be one of {LAYER_METHODS}, got {method!r}")
    return prune_by_score(weight, scores, sparsity, prune_n, prune_m)


def difficulty_under_pruning(
    weight: torch.Tensor,
    inputs: list[torch.Tensor],
    pairs: list[torch.Tensor],
    sparsities: list[float],
    methods=LAYER_METHODS,
    neurons: torch.Tensor | None = None,
) -> dict[str, list[float]]:
    """Mean over ``neurons`` (default: the Wasserstein neurons) of pruned / dense mapping
    difficulty, per method and sparsity (1.0 = fully preserved)."""
    all_pairs = torch.cat(pairs)
    dense = mapping_difficulty(weight, all_pairs)
    if neurons is None:
        outputs = torch.cat(inputs) @ weight.float().t()
        neurons = wasserstein_neurons(wasserstein_to_normal(outputs.t()))
    result = {}
    for method in methods:
        result[method] = []
        for sparsity in sparsities:
            pruned = prune_layer(method, weight, inputs, pairs, sparsity)
            kept = mapping_difficulty(pruned, all_pairs)[neurons] / dense[neurons]
            result[method].append(float(kept.mean()))
    return result


def gamma_sweep(
    weight: torch.Tensor,
    inputs: list[torch.Tensor],
    pairs: list[torch.Tensor],
    gammas: list[float],
    sparsity: float = 0.5,
    prune_n: int = 2,
    prune_m: int = 4,
) -> list[dict[str, float]]:
    """For each gamma: relative MSE of ``W X`` and of ``W dX`` after Whisper pruning of
    this layer alone, and the R^2 of the pruned neuronwise output means against the
    dense ones (paper appendix "Regularizing H_Delta with gamma")."""
    x, dx = torch.cat(inputs), torch.cat(pairs)
    dense_out, dense_diff = x @ weight.float().t(), dx @ weight.float().t()
    dense_means = dense_out.mean(dim=0)
    rows = []
    for gamma in gammas:
        pruned = prune_layer("whisper", weight, inputs, pairs, sparsity, prune_n, prune_m, gamma)
        out, diff = x @ pruned.float().t(), dx @ pruned.float().t()
        residual = ((out.mean(dim=0) - dense_means) ** 2).sum()
        total = ((dense_means - dense_means.mean()) ** 2).sum()
        rows.append(
            {
                "gamma": gamma,
                "mse_outputs": float(((out - dense_out) ** 2).mean() / (dense_out**2).mean()),
                "mse_differences": float(
                    ((diff - dense_diff) ** 2).mean() / (dense_diff**2).mean()
                ),
                "r2_means": float(1 - residual / total),
            }
        )
    return rows
