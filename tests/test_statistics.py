"""Statistics against slow loop implementations written from the paper's equations."""

from __future__ import annotations

import pytest
import torch
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_sparsify import accumulate_hessian
from llmcompressor.modifiers.pruning.wanda.wanda_sparsify import accumulate_row_scalars

from reference import loop_channel_norms, loop_differences, loop_neuronwise
from whisper_modifiers.statistics import (
    SUM_DTYPE,
    add_sequence_channel_norms,
    add_sequence_grams,
    mean_over_sequences,
    neuronwise_difference,
    num_selected_pairs,
    pair_permutations,
    pairwise_differences,
    regularized_difference_hessian,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_sequences(b=3, s=17, m=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, m, generator=g).to(dtype)


# -- pairing ------------------------------------------------------------------------


def test_permutations_are_seeded_permutations():
    a = pair_permutations(50, 3, (0, 7, 2))
    assert a.shape == (3, 50)
    for row in a:
        assert sorted(row.tolist()) == list(range(50))
    assert torch.equal(a, pair_permutations(50, 3, (0, 7, 2)))
    assert not torch.equal(a, pair_permutations(50, 3, (1, 7, 2)))
    assert not torch.equal(a, pair_permutations(50, 3, (0, 7, 3)))
    assert not torch.equal(a[0], a[1])


def test_sequence_of_one_token_has_no_pair():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        pair_permutations(1, 1, (0,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairwise_differences_match_loop(dtype):
    x = random_sequences(1, 9, 5, dtype)[0]
    perms = pair_permutations(9, 2, (3,))
    got = pairwise_differences(x, perms)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), loop_differences(x, perms), rtol=0, atol=1e-6)


# -- Wanda / Wisp channel statistic ----------------------------------------------------


def summed(add, batches):
    total = None
    for batch in batches:
        total = add(total, batch)
    return total


@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_norms_match_loop_over_batches(dtype):
    batches = [random_sequences(3, 11, 6, dtype, 1), random_sequences(2, 11, 6, dtype, 2)]
    total = summed(add_sequence_channel_norms, batches)
    assert total.dtype == SUM_DTYPE
    mean = mean_over_sequences(total, 5)
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean.double(), loop_channel_norms(batches), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_identity_statistic_is_wandas_up_to_float32_rounding(dtype):
    """On X itself (identity pairing) the mean is llmcompressor's Wanda statistic; its
    float32 running mean rounds differently, by a few float32 ulps."""
    module = torch.nn.Linear(6, 4)
    batches = [random_sequences(2, 13, 6, dtype, seed) for seed in range(3)]
    theirs, n_theirs = torch.zeros(6), 0
    for x in batches:
        theirs, n_theirs = accumulate_row_scalars(x, module, theirs, n_theirs)
    ours = mean_over_sequences(summed(add_sequence_channel_norms, batches), 6)
    assert n_theirs == 6
    torch.testing.assert_close(ours, theirs, rtol=4e-7 * 8, atol=0)


@pytest.mark.parametrize("add", [add_sequence_channel_norms, add_sequence_grams])
def test_sums_are_the_same_bits_however_sequences_are_split(add):
    """Batch size and ranks only regroup the sequences: any split, summed in any order of
    its parts (as ranks are), gives the same bits (what makes masks independent of them).
    Magnitudes spread over 2^12, as real activations are."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 33, 16, generator=g) * torch.logspace(-6, 6, 24, base=2).reshape(24, 1, 1)
    reference = add(None, x)  # one batch of 24
    one_by_one = summed(add, [x[i : i + 1] for i in range(24)])
    for size in (1, 3, 4, 7):
        parts = [
            summed(add, [x[i : min(i + size, end)] for i in range(start, end, size)])
            for start, end in ((0, 10), (10, 17), (17, 24))
        ]
        for order in ((0, 1, 2), (2, 0, 1)):
            total = parts[order[0]].clone() + parts[order[1]] + parts[order[2]]
            assert torch.equal(mean_over_sequences(total, 24), mean_over_sequences(reference, 24))
    assert torch.equal(one_by_one, reference)


def test_wisp_statistic_is_norm_of_sampled_differences():
    """||dX_j||^2 for per-sequence permutations, against the loop definition."""
    x = random_sequences(3, 10, 4)
    perms = [pair_permutations(10, 2, (0, b)) for b in range(3)]
    differences = torch.stack([pairwise_differences(x[b], perms[b]) for b in range(3)])
    mean = mean_over_sequences(add_sequence_channel_norms(None, differences), 3)
    expected = loop_channel_norms([[loop_differences(x[b], perms[b]) for b in range(3)]])
    torch.testing.assert_close(mean.double(), expected, rtol=1e-5, atol=0)


# -- Hessians -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_gram_matches_loop_and_sparsegpt(dtype):
    module = torch.nn.Linear(5, 3)
    batches = [random_sequences(2, 9, 5, dtype, s) for s in range(3)]
    theirs, n_theirs = torch.zeros(5, 5), 0
    for batch in batches:
        theirs, n_theirs = accumulate_hessian(batch, module, theirs, n_theirs)
    ours = mean_over_sequences(summed(add_sequence_grams, batches), 6, 2.0)
    # identity statistic = SparseGPT's H up to its float32 running mean's rounding
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    expected = torch.zeros(5, 5, dtype=torch.float64)
    for batch in batches:
        for seq in batch:
            for x in seq.double():
                expected += torch.outer(x, x)
    expected *= 2 / 6  # llmcompressor's H = (2 / num_sequences) X X^T
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)


def test_regularized_difference_hessian_matches_paper():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 40, generator=g), 3 * torch.randn(6, 40, generator=g)
    hessian, difference_hessian = a @ a.T, b @ b.T
    for gamma in (0.0, 0.01, 0.3):
        mu = sum(hessian[j, j] for j in range(6)) / 6
        mu_delta = sum(difference_hessian[j, j] for j in range(6)) / 6
        expected = gamma * hessian + (1 - gamma) * (mu / mu_delta) * difference_hessian
        got = regularized_difference_hessian(hessian, difference_hessian, gamma)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(torch.trace(got), torch.trace(hessian))
    assert torch.equal(regularized_difference_hessian(hessian, difference_hessian, 1.0), hessian)
    with pytest.raises(ValueError, match="gamma must lie in"):
        regularized_difference_hessian(hessian, difference_hessian, 1.5)
    with pytest.raises(ValueError, match="difference Hessian is zero"):
        regularized_difference_hessian(hessian, torch.zeros(6, 6), 0.5)


# -- Wisp+ ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair_fraction", [0.005, 0.1, 0.5])
def test_neuronwise_difference_matches_loop(dtype, pair_fraction):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(7, 5, generator=g).to(dtype)
    differences = pairwise_differences(
        random_sequences(1, 40, 5, dtype)[0], pair_permutations(40, 1, (0,))
    )
    differences[3] = 0  # a zero-distance pair must never be selected
    expected = loop_neuronwise(weight, differences, pair_fraction)
    for chunk in (2, 4096):
        got = neuronwise_difference(weight, differences, pair_fraction, neuron_chunk=chunk)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_neuronwise_difference_skips_zero_pairs_and_caps_k():
    """No pair of nonzero distance: zeros (the sequence adds nothing; issue 50 read how
    many there were into Python to skip it). One: K is capped to it."""
    weight = torch.randn(3, 4)
    differences = torch.zeros(10, 4)
    assert torch.equal(neuronwise_difference(weight, differences, 0.5), torch.zeros(3, 4))
    differences[2] = torch.tensor([1.0, -2.0, 0.0, 3.0])
    got = neuronwise_difference(weight, differences, 0.5)  # K = 5 but one valid pair
    torch.testing.assert_close(got, differences[2].abs().expand(3, 4))


def test_num_selected_pairs():
    assert num_selected_pairs(4096, 0.005) == 20
    assert num_selected_pairs(64, 0.005) == 1
    assert num_selected_pairs(512, 0.005) == 3
