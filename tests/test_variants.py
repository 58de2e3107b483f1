"""Pairing variants (centered, nearest neighbour), Wisp+ specialisation, mapping difficulty."""

from __future__ import annotations

import pytest
import torch

from conftest import NUM_SEQUENCES, linear_weights, load_model
from reference import loop_channel_norms, loop_mapping_difficulty
from test_modifiers import LAYER0, TWO_FOUR, assert_same_weights, record_inputs, two_four_mask
from whisper_modifiers import WhisperModifier, WispModifier, WispPlusModifier
from whisper_modifiers.statistics import (
    add_sequence_channel_norms,
    add_sequence_grams,
    mapping_difficulty,
    nearest_neighbour_differences,
    pair_permutations,
    pairwise_differences,
    scaled_sequence_means,
)


def test_random_pairs_estimate_twice_the_centered_second_moment():
    """E_pi[dX dX^T] = 2 X_c X_c^T (appendix "Centering"), per sequence."""
    x = torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(0)).double()
    draws = 4000
    estimate = torch.zeros(4, 4, dtype=torch.float64)
    for seed in range(draws):
        for b in range(2):
            d = pairwise_differences(x[b], pair_permutations(9, 1, (seed, b))).double()
            estimate += d.T @ d
    estimate /= draws
    centered = x - x.mean(dim=1, keepdim=True)
    expected = 2 * sum(c.T @ c for c in centered)
    torch.testing.assert_close(estimate, expected, rtol=0.05, atol=0.05 * expected.abs().max())


def test_centered_statistics_by_subtraction():
    x = torch.randn(3, 11, 5, generator=torch.Generator().manual_seed(1)) + 2.0
    means = scaled_sequence_means(x)
    norms = add_sequence_channel_norms(None, x)
    correction = add_sequence_channel_norms(None, means)
    gram = add_sequence_grams(None, x)
    gram_correction = add_sequence_grams(None, means)
    centered = x - x.mean(dim=1, keepdim=True)
    direct_norms = add_sequence_channel_norms(None, centered)
    direct_gram = add_sequence_grams(None, centered)
    torch.testing.assert_close(norms - correction, direct_norms, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gram - gram_correction, direct_gram, rtol=1e-4, atol=1e-4)


def test_nearest_neighbours_are_nearest():
    x = torch.randn(30, 6, generator=torch.Generator().manual_seed(2))
    differences = nearest_neighbour_differences(x)
    for ell in range(30):
        distances = [(float((x[ell] - x[j]).norm()), j) for j in range(30) if j != ell]
        nearest = min(distances)[1]
        torch.testing.assert_close(differences[ell], x[ell] - x[nearest])


def test_mapping_difficulty_matches_definition():
    g = torch.Generator().manual_seed(4)
    weight, differences = torch.randn(5, 6, generator=g), torch.randn(21, 6, generator=g)
    differences[3] = 0
    torch.testing.assert_close(
        mapping_difficulty(weight, differences).double(),
        loop_mapping_difficulty(weight, differences),
        rtol=1e-5,
        atol=1e-6,
    )


def test_mapping_difficulty_of_a_hand_made_layer():
    """Neuron 0 reads the channel that separates the two close inputs; neuron 1 reads a
    channel on which all pairs differ in proportion to their distance."""
    differences = torch.tensor([[1.0, 0.0], [0.0, 10.0], [0.0, 10.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # neuron 0: |dy| = 1, 0, 0 -> median 0 -> replaced by 1; ratios 1/(1/10), 0, 0 -> 10/3
    # neuron 1: |dy| = 0, 10, 10 -> median 10; ratios 0, 1/1, 1/1 -> 2/3
    got = mapping_difficulty(weight, differences)
    torch.testing.assert_close(got, torch.tensor([10 / 3, 2 / 3]))


# -- through oneshot ---------------------------------------------------------------------


def test_centered_wisp_uses_the_centered_norm_and_is_deterministic(run_oneshot):
    name = f"{LAYER0}.mlp.gate_proj"
    model = load_model()
    dense = model.get_submodule(name).weight.detach().clone()
    inputs = record_inputs(model, [name])
    run_oneshot([WispModifier(pairing="centered", **TWO_FOUR)], model=model)
    centered = [x[0] - x[0].mean(dim=0) for x in inputs[name][:NUM_SEQUENCES]]
    expected = two_four_mask(dense.double().abs() * loop_channel_norms([centered]).sqrt())
    assert torch.equal(model.get_submodule(name).weight == 0, expected)
    first = linear_weights(run_oneshot([WispModifier(pairing="centered", seed=1, **TWO_FOUR)]))
    again = linear_weights(run_oneshot([WispModifier(pairing="centered", seed=2, **TWO_FOUR)]))
    assert_same_weights(first, again)  # no randomness at all


def test_centered_whisper_is_deterministic_and_differs_from_sparsegpt(run_oneshot):
    first = linear_weights(run_oneshot([WhisperModifier(pairing="centered", seed=1, **TWO_FOUR)]))
    again = linear_weights(run_oneshot([WhisperModifier(pairing="centered", seed=5, **TWO_FOUR)]))
    assert_same_weights(first, again)
    sparsegpt = linear_weights(run_oneshot([WhisperModifier(gamma=1.0, **TWO_FOUR)]))
    gate = f"{LAYER0}.mlp.gate_proj"
    assert not torch.equal(first[gate], sparsegpt[gate])


@pytest.mark.parametrize("cls", [WispModifier, WispPlusModifier, WhisperModifier])
def test_nearest_pairing_runs_and_is_deterministic(run_oneshot, cls):
    a = linear_weights(run_oneshot([cls(pairing="nearest", seed=0, **TWO_FOUR)]))
    b = linear_weights(run_oneshot([cls(pairing="nearest", seed=9, **TWO_FOUR)]))
    assert_same_weights(a, b)
    random = linear_weights(run_oneshot([cls(**TWO_FOUR)]))
    assert not torch.equal(a[f"{LAYER0}.mlp.gate_proj"], random[f"{LAYER0}.mlp.gate_proj"])


def test_pairing_validation():
    with pytest.raises(ValueError, match="not defined for Wisp\\+"):
        WispPlusModifier(pairing="centered", **TWO_FOUR)
    with pytest.raises(ValueError, match="num_permutations applies to pairing 'random'"):
        WispModifier(pairing="nearest", num_permutations=2, **TWO_FOUR)
    with pytest.raises(ValueError, match="pairing"):
        WhisperModifier(pairing="sideways", **TWO_FOUR)


def test_specialized_fraction_interpolates_wisp_and_wisp_plus(run_oneshot):
    wisp = linear_weights(run_oneshot([WispModifier(**TWO_FOUR)]))
    none = linear_weights(run_oneshot([WispPlusModifier(specialized_fraction=0.0, **TWO_FOUR)]))
    assert_same_weights(none, wisp)
    full = linear_weights(run_oneshot([WispPlusModifier(**TWO_FOUR)]))
    half = linear_weights(run_oneshot([WispPlusModifier(specialized_fraction=0.5, **TWO_FOUR)]))
    assert_same_weights(
        linear_weights(run_oneshot([WispPlusModifier(specialized_fraction=1.0, **TWO_FOUR)])), full
    )
    gate = f"{LAYER0}.mlp.gate_proj"
    rows_like_full = (half[gate] == full[gate]).all(dim=1)
    rows_like_wisp = (half[gate] == wisp[gate]).all(dim=1)
    assert (rows_like_full | rows_like_wisp).all()  # every row is one or the other
    assert rows_like_full.sum() >= half[gate].shape[0] // 2
    assert (~rows_like_full).any()
