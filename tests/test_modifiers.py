"""The modifiers through llmcompressor's oneshot on the real stories260K model."""

from __future__ import annotations

import zlib

import pytest
import torch
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_sparsify import sparsify_weight

from conftest import NUM_SEQUENCES, linear_weights, load_model
from reference import (
    loop_channel_norms,
    loop_differences,
    loop_hessian,
    loop_neuronwise,
    loop_regularized_hessian,
)
from whisper_modifiers import (
    OneShotMagnitudeModifier,
    WhisperModifier,
    WispModifier,
    WispPlusModifier,
)
from whisper_modifiers.statistics import pair_permutations

TWO_FOUR = {"sparsity": 0.5, "mask_structure": "2:4"}
STOCK_IGNORE = ["re:.*lm_head"]  # llmcompressor 0.14 names lm_head "lm_head."
LAYER0 = "model.layers.0"
ATTENTION_AND_DOWN = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.down_proj",
]


def assert_same_weights(a, b):
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"weights differ in {different[:5]}"


def record_inputs(model, names):
    """Forward hooks that record what each named module receives during oneshot.

    The sequential pipeline runs each layer twice (calibration, then propagation of the
    pruned outputs); the first ``NUM_SEQUENCES`` calls are the calibration inputs."""
    inputs = {name: [] for name in names}
    for name in names:
        module = model.get_submodule(name)
        module.register_forward_hook(
            lambda _m, args, _o, name=name: inputs[name].append(args[0].detach().clone())
        )
    return inputs


def calibration_inputs(inputs):
    assert len(inputs) == 2 * NUM_SEQUENCES  # calibrated, then propagated
    return inputs[:NUM_SEQUENCES]


def permutations_used(name, index, seq_len, seed=0, num_permutations=1):
    """The pairs a module used: up_proj shares gate_proj's input, hence its pairs."""
    name = name.replace("up_proj", "gate_proj")
    return pair_permutations(seq_len, num_permutations, (seed, zlib.crc32(name.encode()), index))


# -- exact equivalences --------------------------------------------------------------


def test_whisper_gamma_one_is_sparsegpt(run_oneshot):
    ours = run_oneshot([WhisperModifier(gamma=1.0, **TWO_FOUR)])
    stock = run_oneshot([SparseGPTModifier(ignore=STOCK_IGNORE, **TWO_FOUR)])
    assert_same_weights(linear_weights(ours), linear_weights(stock))


@pytest.mark.parametrize(
    ("ours", "stock"),
    [
        (WispModifier, WandaPruningModifier),
        (WispPlusModifier, WandaPruningModifier),
        (WhisperModifier, SparseGPTModifier),
    ],
)
@pytest.mark.parametrize("structure", [TWO_FOUR, {"sparsity": 0.6}])
def test_no_difference_targets_is_the_stock_method(run_oneshot, ours, stock, structure):
    mine = run_oneshot([ours(difference_targets=[], **structure)])
    theirs = run_oneshot([stock(ignore=STOCK_IGNORE, **structure)])
    assert_same_weights(linear_weights(mine), linear_weights(theirs))


# -- routing: gate/up get the difference statistic, the rest the standard one ------------


def stock_layer0(run_oneshot, stock):
    model = run_oneshot([stock(ignore=STOCK_IGNORE, **TWO_FOUR)])
    return {name: w for name, w in linear_weights(model).items() if name.startswith(LAYER0)}


@pytest.mark.parametrize("ours", [WispModifier, WispPlusModifier, WhisperModifier])
def test_attention_and_down_keep_the_standard_method(run_oneshot, ours):
    stock = WandaPruningModifier if ours is not WhisperModifier else SparseGPTModifier
    expected = stock_layer0(run_oneshot, stock)
    got = linear_weights(run_oneshot([ours(**TWO_FOUR)]))
    for suffix in ATTENTION_AND_DOWN:  # layer 0 sees the dense inputs in both runs
        assert torch.equal(got[f"{LAYER0}.{suffix}"], expected[f"{LAYER0}.{suffix}"]), suffix
    for suffix in ("mlp.gate_proj", "mlp.up_proj"):
        assert not torch.equal(got[f"{LAYER0}.{suffix}"], expected[f"{LAYER0}.{suffix}"])


def two_four_mask(scores):
    groups = scores.reshape(scores.shape[0], -1, 4)
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(-1, groups.topk(2, dim=-1, largest=False).indices, True)
    return mask.reshape(scores.shape)


@pytest.mark.parametrize("suffix", ["mlp.gate_proj", "mlp.up_proj"])
def test_wisp_gate_up_get_the_difference_norm(run_oneshot, suffix):
    """Rebuild layer 0's Wisp mask from the inputs the module received, with the loop
    reference of ||dX_j||_2, and compare it with what the modifier produced."""
    name = f"{LAYER0}.{suffix}"
    model = load_model()
    dense = model.get_submodule(name).weight.detach().clone()
    inputs = record_inputs(model, [name])
    run_oneshot([WispModifier(**TWO_FOUR)], model=model)
    differences = [
        loop_differences(x[0], permutations_used(name, i, x.shape[1]))
        for i, x in enumerate(calibration_inputs(inputs[name]))
    ]
    scores = dense.double().abs() * loop_channel_norms([differences]).sqrt()
    expected_mask = two_four_mask(scores)
    assert torch.equal(model.get_submodule(name).weight == 0, expected_mask)
    wanda_scores = (
        dense.double().abs()
        * loop_channel_norms([[x[0] for x in calibration_inputs(inputs[name])]]).sqrt()
    )
    assert not torch.equal(expected_mask, two_four_mask(wanda_scores))


def test_wisp_plus_gate_gets_the_neuronwise_statistic(run_oneshot):
    name = f"{LAYER0}.mlp.gate_proj"
    model = load_model()
    dense = model.get_submodule(name).weight.detach().clone()
    inputs = record_inputs(model, [name])
    run_oneshot([WispPlusModifier(pair_fraction=0.05, **TWO_FOUR)], model=model)
    statistic = (
        sum(
            loop_neuronwise(
                dense, loop_differences(x[0], permutations_used(name, i, x.shape[1])), 0.05
            )
            for i, x in enumerate(calibration_inputs(inputs[name]))
        )
        / NUM_SEQUENCES
    )
    expected_mask = two_four_mask(dense.double().abs() * statistic)
    assert torch.equal(model.get_submodule(name).weight == 0, expected_mask)


def test_whisper_gate_gets_the_regularized_difference_hessian(run_oneshot):
    name = f"{LAYER0}.mlp.up_proj"
    model = load_model()
    module = model.get_submodule(name)
    dense = module.weight.detach().clone()
    inputs = record_inputs(model, [name])
    run_oneshot([WhisperModifier(gamma=0.2, **TWO_FOUR)], model=model)
    differences = [
        loop_differences(x[0], permutations_used(name, i, x.shape[1]))
        for i, x in enumerate(calibration_inputs(inputs[name]))
    ]
    hessian = loop_regularized_hessian(
        loop_hessian([x[0] for x in calibration_inputs(inputs[name])]),
        loop_hessian(differences),
        0.2,
    )
    reference = torch.nn.Linear(dense.shape[1], dense.shape[0], bias=False)
    reference.weight.data.copy_(dense)
    _, expected = sparsify_weight(
        reference, {reference: hessian.float()}, 0.5, 2, 4, 128, 0.01, False
    )
    torch.testing.assert_close(module.weight.detach(), expected, rtol=1e-3, atol=1e-4)


# -- patterns, untouched modules, determinism -------------------------------------------


@pytest.mark.parametrize("ours", [WispModifier, WispPlusModifier, WhisperModifier])
def test_exact_two_four_pattern_and_untouched_head(run_oneshot, ours):
    dense = load_model()
    model = run_oneshot([ours(**TWO_FOUR)])
    for name, weight in linear_weights(model).items():
        if name == "lm_head":
            continue
        zeros = (weight == 0).reshape(weight.shape[0], -1, 4).sum(-1)
        assert (zeros == 2).all(), name  # exactly 2 of every 4 along the input dimension
    assert torch.equal(model.lm_head.weight, dense.lm_head.weight)
    assert torch.equal(model.model.embed_tokens.weight, dense.model.embed_tokens.weight)


@pytest.mark.parametrize("ours", [WispModifier, WispPlusModifier])
def test_unstructured_is_equal_per_row(run_oneshot, ours):
    model = run_oneshot([ours(sparsity=0.65)])
    for name, weight in linear_weights(model).items():
        if name != "lm_head":
            assert ((weight == 0).sum(1) == int(weight.shape[1] * 0.65)).all(), name


def test_whisper_unstructured_sparsity(run_oneshot):
    model = run_oneshot([WhisperModifier(sparsity=0.65)])
    for name, weight in linear_weights(model).items():
        if name != "lm_head":
            assert abs((weight == 0).float().mean().item() - 0.65) < 0.01, name


@pytest.mark.parametrize("ours", [WispModifier, WispPlusModifier, WhisperModifier])
def test_same_seed_same_masks_other_seed_other_masks(run_oneshot, ours):
    first = linear_weights(run_oneshot([ours(seed=3, **TWO_FOUR)]))
    again = linear_weights(run_oneshot([ours(seed=3, **TWO_FOUR)]))
    other = linear_weights(run_oneshot([ours(seed=4, **TWO_FOUR)]))
    assert_same_weights(first, again)
    gate = f"{LAYER0}.mlp.gate_proj"
    assert not torch.equal(first[gate] == 0, other[gate] == 0)


def test_more_permutations_change_the_statistic(run_oneshot):
    one = linear_weights(run_oneshot([WispModifier(**TWO_FOUR)]))
    four = linear_weights(run_oneshot([WispModifier(num_permutations=4, **TWO_FOUR)]))
    assert not torch.equal(one[f"{LAYER0}.mlp.gate_proj"], four[f"{LAYER0}.mlp.gate_proj"])


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("ours", [WispModifier, WispPlusModifier, WhisperModifier])
@pytest.mark.parametrize("sparsity", [1.0, -0.1, 1.5])
def test_sparsity_outside_unit_interval(ours, sparsity):
    with pytest.raises(ValueError, match=r"sparsity must be a number in \[0, 1\)"):
        ours(sparsity=sparsity)


@pytest.mark.parametrize("structure", ["2-4", "4:2", "2:2", "a:b", "2:4:8", "0:4"])
def test_malformed_mask_structure(structure):
    with pytest.raises(ValueError, match="mask_structure"):
        WispModifier(sparsity=0.5, mask_structure=structure)


@pytest.mark.parametrize("ours", [WispModifier, WhisperModifier])
def test_n_m_that_does_not_divide_a_layer_is_refused_naming_it(run_oneshot, ours):
    """stories260K's down_proj has 172 inputs: 4:8 would zero its last group whole."""
    modifier = ours(sparsity=0.5, mask_structure="4:8")
    message = r"mask_structure '4:8' needs a multiple of 8 inputs .* model.layers.0.mlp.down_proj"
    with pytest.raises(ValueError, match=message):
        modifier.check_difference_targets(load_model())  # whisper-prune's preflight
    with pytest.raises(ValueError, match=message):
        run_oneshot([ours(sparsity=0.5, mask_structure="4:8")])


def test_sparsity_must_agree_with_n_m():
    with pytest.raises(ValueError, match="contradicts mask_structure"):
        WhisperModifier(sparsity=0.7, mask_structure="2:4")


@pytest.mark.parametrize(
    ("field", "value"),
    [("gamma", 1.5), ("gamma", -0.1), ("num_permutations", 0), ("pair_fraction", 0.0)],
)
def test_out_of_range_fields(field, value):
    cls = WhisperModifier if field == "gamma" else WispPlusModifier
    with pytest.raises(ValueError, match=field):
        cls(sparsity=0.5, **{field: value})


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="gammma"):
        WhisperModifier(sparsity=0.5, gammma=0.1)


def test_difference_targets_matching_nothing(run_oneshot):
    with pytest.raises(ValueError, match=r"'re:.*gate_projection' matches none .*model\.layers"):
        run_oneshot([WispModifier(difference_targets=["re:.*gate_projection"], **TWO_FOUR)])


def test_difference_target_that_is_ignored_matches_nothing(run_oneshot):
    modifier = WispModifier(
        sparsity=0.5, difference_targets=["re:.*up_proj$"], ignore=["lm_head", "re:.*mlp.*"]
    )
    with pytest.raises(ValueError, match="matches none"):
        run_oneshot([modifier])


@pytest.mark.parametrize("ours", [WispModifier, WispPlusModifier, WhisperModifier])
def test_sequences_of_one_token(run_oneshot, ours):
    from datasets import Dataset

    short = Dataset.from_dict({"input_ids": [[5], [7]], "attention_mask": [[1], [1]]})
    with pytest.raises(ValueError, match="at least 2 tokens"):
        run_oneshot([ours(**TWO_FOUR)], dataset=short)


def test_nan_activations(run_oneshot):
    model = load_model()
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        run_oneshot([WispModifier(**TWO_FOUR)], model=model)


# -- magnitude baseline ----------------------------------------------------------------


@pytest.mark.parametrize("structure", [TWO_FOUR, {"sparsity": 0.65}])
def test_magnitude_prunes_smallest_weights(run_oneshot, structure):
    dense = linear_weights(load_model())
    pruned = linear_weights(run_oneshot([OneShotMagnitudeModifier(**structure)]))
    assert torch.equal(pruned["lm_head"], dense["lm_head"])
    for name, weight in pruned.items():
        if name == "lm_head":
            continue
        w = dense[name]
        if structure.get("mask_structure") == "2:4":
            groups = w.abs().reshape(w.shape[0], -1, 4)
            expected = torch.zeros_like(groups, dtype=torch.bool)
            expected.scatter_(-1, groups.topk(2, -1, largest=False).indices, True)
            expected = expected.reshape(w.shape)
        else:
            k = int(w.shape[1] * 0.65)
            expected = torch.zeros_like(w, dtype=torch.bool)
            expected.scatter_(1, w.abs().argsort(dim=1, stable=True)[:, :k], True)
        assert torch.equal(weight == 0, expected), name
        assert torch.equal(weight[~expected], w[~expected])  # survivors unchanged
