"""RIA and ALPS solvers, and the composite modifiers (RIA-Wisp, RIA-Wisp+, ALPS-Whisper)."""

from __future__ import annotations

import pytest
import torch
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_sparsify import sparsify_weight

from conftest import linear_weights, load_model
from reference import loop_ria
from test_modifiers import (
    ATTENTION_AND_DOWN,
    LAYER0,
    TWO_FOUR,
    assert_same_weights,
)
from whisper_modifiers import (
    ALPSModifier,
    ALPSWhisperModifier,
    RIAModifier,
    RIAWispModifier,
    RIAWispPlusModifier,
)
from whisper_modifiers.alps import alps_prune
from whisper_modifiers.solvers import prune_mask, ria_scores

# -- RIA ------------------------------------------------------------------------------


@pytest.mark.parametrize("per_neuron", [False, True])
def test_ria_scores_match_direct_formula(per_neuron):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 9, generator=g)
    scale = torch.rand(6, 9, generator=g) if per_neuron else torch.rand(9, generator=g)
    torch.testing.assert_close(ria_scores(weight, scale).double(), loop_ria(weight, scale))


def test_layer_comparison_group():
    scores = torch.rand(7, 13)
    mask = prune_mask(scores, 0.6, comparison_group="layer")
    assert int(mask.sum()) == int(7 * 13 * 0.6)
    assert scores[mask].max() <= scores[~mask].min()
    assert not (mask.sum(1) == mask.sum(1)[0]).all()  # rows differ: a per-layer threshold
    with pytest.raises(ValueError, match="comparison_group"):
        prune_mask(scores, 0.5, comparison_group="column")


# -- ALPS -----------------------------------------------------------------------------


def correlated_layer(n=96, m=64, s=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(m, m, generator=g) / m**0.5
    x = (torch.randn(s, m, generator=g) @ mixing + 0.3 * torch.randn(s, m, generator=g)).T
    return torch.randn(n, m, generator=g), x


def relative_error(weight, pruned, x):
    return float(((weight - pruned.detach()) @ x).norm() ** 2 / (weight @ x).norm() ** 2)


@pytest.mark.parametrize(("sparsity", "n", "m"), [(0.5, 2, 4), (0.5, 0, 0), (0.7, 0, 0)])
def test_alps_reconstructs_better_than_sparsegpt(sparsity, n, m):
    weight, x = correlated_layer()
    hessian = x @ x.T
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    module.weight.data.copy_(weight)
    _, sparsegpt = sparsify_weight(
        module, {module: hessian.clone()}, sparsity, n, m, 128, 0.01, False
    )
    result = alps_prune(weight, hessian, sparsity, n, m)
    assert relative_error(weight, result.weight, x) < relative_error(weight, sparsegpt, x)
    zeros = result.weight == 0
    if n:
        assert (zeros.reshape(weight.shape[0], -1, m).sum(-1) == n).all()
    else:
        assert int(zeros.sum()) == weight.numel() - round((1 - sparsity) * weight.numel())


def test_alps_converges_near_the_known_optimum_of_a_diagonal_problem():
    """With a diagonal H the problem separates: the optimum keeps the k largest
    importances |W_ij| sqrt(H_jj + lambda_2) unchanged and its cost is the sum of the
    squared pruned importances.  ADMM (non-convex) must stop by its own rule, on a
    support whose cost is within 5% of that optimum, with the survivors unchanged."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 32, generator=g)
    diagonal = torch.rand(32, generator=g) + 0.5
    result = alps_prune(weight, torch.diag(diagonal), 0.6)
    importance = weight.abs() * (diagonal + 0.01 * diagonal.mean()).sqrt()
    keep = round(0.4 * weight.numel())
    optimum = importance.reshape(-1).sort().values[: weight.numel() - keep].pow(2).sum()
    kept = result.weight != 0
    assert int(kept.sum()) == keep
    assert result.iterations < 300
    torch.testing.assert_close(result.weight[kept], weight[kept])
    cost = importance[~kept].pow(2).sum()
    assert optimum <= cost <= 1.05 * optimum
    random_support = importance.reshape(-1)[torch.randperm(weight.numel(), generator=g)]
    assert cost < random_support[: weight.numel() - keep].pow(2).sum()


def test_alps_keeps_an_already_sparse_optimum():
    weight, x = correlated_layer(seed=1)
    sparse = weight * (torch.rand(weight.shape, generator=torch.Generator().manual_seed(2)) > 0.5)
    result = alps_prune(sparse, x @ x.T, float((sparse == 0).float().mean()))
    torch.testing.assert_close(result.weight, sparse, rtol=1e-4, atol=1e-4)


# -- composite modifiers --------------------------------------------------------------


@pytest.mark.parametrize("cls", [RIAWispModifier, RIAWispPlusModifier])
def test_ria_composites_without_targets_are_ria(run_oneshot, cls):
    ria = linear_weights(run_oneshot([RIAModifier(**TWO_FOUR)]))
    mine = linear_weights(run_oneshot([cls(difference_targets=[], **TWO_FOUR)]))
    assert_same_weights(mine, ria)


def test_alps_whisper_gamma_one_is_alps(run_oneshot):
    alps = linear_weights(run_oneshot([ALPSModifier(**TWO_FOUR)]))
    mine = linear_weights(run_oneshot([ALPSWhisperModifier(gamma=1.0, **TWO_FOUR)]))
    assert_same_weights(mine, alps)


@pytest.mark.parametrize(
    ("composite", "baseline"),
    [
        (RIAWispModifier, RIAModifier),
        (RIAWispPlusModifier, RIAModifier),
        (ALPSWhisperModifier, ALPSModifier),
    ],
)
def test_composites_route_gate_up_only(run_oneshot, composite, baseline):
    expected = linear_weights(run_oneshot([baseline(**TWO_FOUR)]))
    got = linear_weights(run_oneshot([composite(**TWO_FOUR)]))
    for suffix in ATTENTION_AND_DOWN:
        assert torch.equal(got[f"{LAYER0}.{suffix}"], expected[f"{LAYER0}.{suffix}"]), suffix
    for suffix in ("mlp.gate_proj", "mlp.up_proj"):
        assert not torch.equal(got[f"{LAYER0}.{suffix}"], expected[f"{LAYER0}.{suffix}"])


def test_ria_uses_layer_groups_for_unstructured(run_oneshot):
    model = run_oneshot([RIAModifier(sparsity=0.5)])
    gate = model.get_submodule(f"{LAYER0}.mlp.gate_proj").weight
    assert int((gate == 0).sum()) == int(gate.numel() * 0.5)
    per_row = (gate == 0).sum(1)
    assert not (per_row == per_row[0]).all()


@pytest.mark.parametrize("cls", [ALPSModifier, ALPSWhisperModifier])
@pytest.mark.parametrize("structure", [TWO_FOUR, {"sparsity": 0.65}])
def test_alps_modifiers_patterns(run_oneshot, cls, structure):
    dense = load_model()
    model = run_oneshot([cls(**structure)])
    for name, weight in linear_weights(model).items():
        if name == "lm_head":
            assert torch.equal(weight, dense.lm_head.weight)
        elif "mask_structure" in structure:
            assert ((weight == 0).reshape(weight.shape[0], -1, 4).sum(-1) == 2).all(), name
        else:
            expected = weight.numel() - round(0.35 * weight.numel())
            assert int((weight == 0).sum()) == expected, name
