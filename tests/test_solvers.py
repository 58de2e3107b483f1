"""The no-update solver against llmcompressor's Wanda and the mask definitions."""

from __future__ import annotations

import pytest
import torch
from llmcompressor.modifiers.pruning.wanda.wanda_sparsify import sparsify_weight

from whisper_modifiers.solvers import prune_by_score, prune_mask


@pytest.mark.parametrize(("sparsity", "n", "m"), [(0.5, 2, 4), (0.5, 0, 0), (0.65, 0, 0)])
def test_wanda_score_reproduces_wanda(sparsity, n, m):
    g = torch.Generator().manual_seed(0)
    module = torch.nn.Linear(32, 12, bias=False)
    torch.nn.init.normal_(module.weight, generator=g)
    row_scalars = torch.rand(32, generator=g) + 0.1
    expected = sparsify_weight(module, {module: row_scalars.clone()}, sparsity, n, m)
    scores = module.weight.abs() * torch.sqrt(row_scalars.reshape(1, -1))
    got = prune_by_score(module.weight.detach(), scores, sparsity, n, m)
    assert torch.equal(got, expected)


def test_n_m_mask_is_exact():
    scores = torch.rand(9, 24)
    mask = prune_mask(scores, 0.5, 2, 4)
    groups = mask.reshape(9, 6, 4)
    assert (groups.sum(-1) == 2).all()
    # the pruned two are the two smallest of each group
    kept_min = torch.where(~groups, scores.reshape(9, 6, 4), torch.inf).amin(-1)
    pruned_max = torch.where(groups, scores.reshape(9, 6, 4), -torch.inf).amax(-1)
    assert (pruned_max <= kept_min).all()


def test_unstructured_mask_is_per_row():
    scores = torch.rand(5, 40)
    mask = prune_mask(scores, 0.65)
    assert (mask.sum(1) == 26).all()


def test_n_m_needs_divisible_columns():
    with pytest.raises(ValueError, match="divisible by 4"):
        prune_mask(torch.rand(3, 10), 0.5, 2, 4)


@pytest.mark.parametrize(
    ("sparsity", "n", "m", "block_size"),
    [(0.5, 2, 4, 128), (0.65, 0, 0, 128), (0.5, 0, 0, 16), (0.5, 2, 4, 24)],
)
def test_batched_sparsegpt_is_llmcompressors_per_problem(sparsity, n, m, block_size):
    """Each problem of the batch gives what llmcompressor's ``sparsify_weight`` gives it
    alone, bit for bit; a dead input and a Hessian too singular to invert are handled as there."""
    from llmcompressor.modifiers.pruning.sparsegpt.sgpt_sparsify import (
        sparsify_weight as sparsegpt_sparsify_weight,
    )

    from whisper_modifiers.solvers import sparsegpt_prune_batch

    g = torch.Generator().manual_seed(0)
    columns, rows = 40, 24
    weights = torch.randn(4, rows, columns, generator=g)
    inputs = torch.randn(4, columns, 200, generator=g)
    inputs[1, 7] = 0  # a dead input channel
    hessians = inputs @ inputs.transpose(1, 2) / 200
    hessians[3] = -torch.eye(columns)  # not positive definite: the identity fallback
    got = sparsegpt_prune_batch(weights, hessians, sparsity, n, m, block_size, 0.01)
    for b in range(4):
        module = torch.nn.Linear(columns, rows, bias=False)
        module.weight.data.copy_(weights[b])
        _, expected = sparsegpt_sparsify_weight(
            module, {module: hessians[b].clone()}, sparsity, n, m, block_size, 0.01, False
        )
        assert torch.equal(got[b], expected)
    assert (got[1][:, 7] == 0).all()
