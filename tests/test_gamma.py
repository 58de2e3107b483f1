"""The gamma-regularised Wisp / Wisp+ and ``gamma: auto`` (issue 14)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_sparsify import sparsify_weight

from conftest import NUM_SEQUENCES, linear_weights, load_model
from reference import (
    loop_channel_norms,
    loop_differences,
    loop_neuronwise,
    loop_regularized_hessian,
    loop_regularized_norms,
)
from test_modifiers import (
    LAYER0,
    STOCK_IGNORE,
    TWO_FOUR,
    assert_same_weights,
    calibration_inputs,
    permutations_used,
    record_inputs,
    two_four_mask,
)
from whisper_modifiers import (
    ALPSWhisperModifier,
    WhisperModifier,
    WispModifier,
    WispPlusModifier,
)
from whisper_modifiers.modifiers.model_check import held_out_sequences, sequence_losses
from whisper_modifiers.selection import (
    choose_gamma,
    gated_mlp_errors,
    held_out_fold,
    held_out_tokens,
    output_errors,
    paired_means,
    paired_sums,
    select_gamma,
    sequence_error,
)
from whisper_modifiers.statistics import (
    add_sequence_grams,
    mean_over_sequences,
    pair_permutations,
    pairwise_differences,
    regularized_difference_hessian,
    regularized_difference_norms,
)

GATE_UP = [f"model.layers.{i}.mlp.{part}" for i in range(5) for part in ("gate_proj", "up_proj")]

# -- the statistic ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(12,), (5, 12)])
def test_regularized_norms_against_the_loop_reference(shape):
    generator = torch.Generator().manual_seed(0)
    norms = torch.rand(12, generator=generator, dtype=torch.float64) * 3
    difference = torch.rand(shape, generator=generator, dtype=torch.float64)
    for gamma in (0.0, 0.01, 0.3):
        torch.testing.assert_close(
            regularized_difference_norms(norms, difference, gamma),
            loop_regularized_norms(norms, difference, gamma),
        )
    assert regularized_difference_norms(norms, difference, 1.0) is norms
    with pytest.raises(ValueError, match="gamma must lie in"):
        regularized_difference_norms(norms, difference, -0.5)
    with pytest.raises(ValueError, match="difference statistic is zero"):
        regularized_difference_norms(norms, torch.zeros(shape, dtype=torch.float64), 0.5)


def test_regularized_norms_are_the_diagonal_of_whispers_hessian():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=generator, dtype=torch.float64)
    dx = torch.randn(40, 8, generator=generator, dtype=torch.float64)
    hessian, difference_hessian = x.t() @ x, dx.t() @ dx
    for gamma in (0.0, 0.2, 0.9):
        torch.testing.assert_close(
            regularized_difference_norms(hessian.diagonal(), difference_hessian.diagonal(), gamma),
            loop_regularized_hessian(hessian, difference_hessian, gamma).diagonal(),
        )


# -- exact equivalences ----------------------------------------------------------------


@pytest.mark.parametrize("ours", [WispModifier, WispPlusModifier])
@pytest.mark.parametrize("structure", [TWO_FOUR, {"sparsity": 0.6}])
def test_gamma_one_is_wanda_bit_for_bit(run_oneshot, ours, structure):
    wanda = linear_weights(run_oneshot([WandaPruningModifier(ignore=STOCK_IGNORE, **structure)]))
    assert_same_weights(linear_weights(run_oneshot([ours(gamma=1.0, **structure)])), wanda)


@pytest.mark.parametrize("ours", [WispModifier, WispPlusModifier])
def test_gamma_zero_is_the_default_method_bit_for_bit(run_oneshot, ours):
    assert ours.model_fields["gamma"].default == 0.0
    default = linear_weights(run_oneshot([ours(**TWO_FOUR)]))
    assert_same_weights(linear_weights(run_oneshot([ours(gamma=0.0, **TWO_FOUR)])), default)
    mixed = linear_weights(run_oneshot([ours(gamma=0.3, **TWO_FOUR)]))
    assert not torch.equal(mixed[f"{LAYER0}.mlp.gate_proj"], default[f"{LAYER0}.mlp.gate_proj"])


def test_wisp_mixture_against_the_loop_reference(run_oneshot):
    """Layer 0's gate mask at gamma 0.3 from the inputs it received: |W_ij| sqrt(0.3
    ||X_j||^2 + 0.7 (mu / mu_Delta) ||dX_j||^2), every piece from the loop reference."""
    name = f"{LAYER0}.mlp.gate_proj"
    model = load_model()
    dense = model.get_submodule(name).weight.detach().clone()
    inputs = record_inputs(model, [name])
    run_oneshot([WispModifier(gamma=0.3, **TWO_FOUR)], model=model)
    sequences = [x[0] for x in calibration_inputs(inputs[name])]
    differences = [
        loop_differences(x, permutations_used(name, i, x.shape[0])) for i, x in enumerate(sequences)
    ]
    statistic = loop_regularized_norms(
        loop_channel_norms([sequences]), loop_channel_norms([differences]), 0.3
    )
    expected = two_four_mask(dense.double().abs() * statistic.sqrt())
    assert torch.equal(model.get_submodule(name).weight == 0, expected)


def test_wisp_plus_mixture_against_the_loop_reference(run_oneshot):
    name = f"{LAYER0}.mlp.up_proj"
    model = load_model()
    dense = model.get_submodule(name).weight.detach().clone()
    inputs = record_inputs(model, [name])
    run_oneshot([WispPlusModifier(gamma=0.5, pair_fraction=0.05, **TWO_FOUR)], model=model)
    sequences = [x[0] for x in calibration_inputs(inputs[name])]
    neuronwise = sum(
        loop_neuronwise(dense, loop_differences(x, permutations_used(name, i, x.shape[0])), 0.05)
        for i, x in enumerate(sequences)
    ) / len(sequences)
    statistic = loop_regularized_norms(loop_channel_norms([sequences]), neuronwise**2, 0.5)
    expected = two_four_mask(dense.double().abs() * statistic.sqrt())
    assert torch.equal(model.get_submodule(name).weight == 0, expected)


# -- gamma: auto -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ours", [WispModifier, WispPlusModifier, WhisperModifier], ids=lambda c: c.__name__
)
def test_auto_is_deterministic_and_recorded(run_oneshot, ours):
    runs = []
    for _ in range(2):
        modifier = ours(gamma="auto", **TWO_FOUR)
        weights = linear_weights(run_oneshot([modifier]))
        runs.append((weights, modifier.gamma_selection()))
    assert_same_weights(runs[0][0], runs[1][0])
    selection = runs[0][1]
    assert selection == runs[1][1]
    assert sorted(selection) == sorted(GATE_UP)
    candidates = [str(gamma) for gamma in ours.GAMMA_CANDIDATES]
    for i in range(5):
        gate, up = (selection[f"model.layers.{i}.mlp.{part}"] for part in ("gate_proj", "up_proj"))
        assert gate == up  # one choice for the gated pair
        assert list(gate["held_out_error"]) == list(gate["difference_se"]) == candidates
        assert gate["chosen_gamma"] == choose_gamma(
            {float(g): e for g, e in gate["held_out_error"].items()},
            {float(g): se for g, se in gate["difference_se"].items()},
            modifier.gamma_evidence,
        )
    for name, weight in runs[0][0].items():
        if "layers" in name:
            assert torch.equal(weight == 0, two_four_mask(weight.abs() + (weight != 0)))


@pytest.mark.parametrize(
    ("ours", "fields"),
    [
        (WhisperModifier, {"pairing": "centered"}),
        (WispModifier, {"pairing": "centered"}),
        (WispPlusModifier, {"pairing": "nearest"}),
        (ALPSWhisperModifier, {"alps_max_iter": 30}),
    ],
    ids=["whisper-centered", "wisp-centered", "wisp_plus-nearest", "alps_whisper"],
)
def test_auto_with_other_pairings_and_solvers(run_oneshot, ours, fields):
    modifier = ours(gamma="auto", **fields, **TWO_FOUR)
    weights = linear_weights(run_oneshot([modifier]))
    assert sorted(modifier.gamma_selection()) == sorted(GATE_UP)
    for name in GATE_UP:
        assert torch.equal(
            weights[name] == 0, two_four_mask(weights[name].abs() + (weights[name] != 0))
        )


def test_auto_with_one_candidate_is_that_gamma(run_oneshot):
    """The held-out sequences join the statistics for the final solve, after the others;
    the statistics are order-independent sums, so one candidate gives the fixed-gamma
    model bit for bit."""
    for cls, gamma in ((WhisperModifier, 0.1), (WispModifier, 0.3)):
        auto = run_oneshot([cls(gamma="auto", gamma_candidates=[gamma], **TWO_FOUR)])
        fixed = run_oneshot([cls(gamma=gamma, **TWO_FOUR)])
        assert_same_weights(linear_weights(auto), linear_weights(fixed))


@pytest.mark.parametrize(
    ("ours", "stock"),
    [(WhisperModifier, SparseGPTModifier), (WispModifier, WandaPruningModifier)],
)
def test_auto_that_keeps_gamma_one_everywhere_is_the_baseline_bit_for_bit(run_oneshot, ours, stock):
    """An evidence bar no candidate clears keeps the baseline's gamma in every layer: the
    model is then SparseGPT's / Wanda's, bit for bit (the held-out sequences, replayed
    last, do not change a sum)."""
    auto = ours(gamma="auto", gamma_evidence=1e9, **TWO_FOUR)
    model = run_oneshot([auto])
    assert {choice["gamma"] for choice in auto.gamma_selection().values()} == {1.0}
    baseline = run_oneshot([stock(ignore=STOCK_IGNORE, **TWO_FOUR)])
    assert_same_weights(linear_weights(model), linear_weights(baseline))


@pytest.mark.parametrize("structure", [TWO_FOUR, {"sparsity": 0.65}], ids=["2:4", "0.65"])
def test_whisper_candidates_in_one_batch_are_the_per_module_solves(
    run_oneshot, monkeypatch, structure
):
    """Whisper solves gate and up at every candidate as one batch; each is llmcompressor's
    ``sparsify_weight`` with ``H~`` at that gamma, bit for bit."""
    batched = WhisperModifier.candidate_weights
    groups = []

    def checked(self, group, gammas):
        got = batched(self, group, gammas)
        expected = [{m: self.candidate_weight(m, gamma) for m in group} for gamma in gammas]
        for got_weights, expected_weights in zip(got, expected, strict=True):
            for module in group:
                assert torch.equal(got_weights[module], expected_weights[module])
        groups.append((len(group), len(gammas)))
        return got

    monkeypatch.setattr(WhisperModifier, "candidate_weights", checked)
    run_oneshot([WhisperModifier(gamma="auto", **structure)])
    candidates = len(WhisperModifier.GAMMA_CANDIDATES)
    assert [g for g in groups if g[1] == candidates] == [(2, candidates)] * 5  # gate and up
    assert all(g == (2, 1) for g in groups if g[1] != candidates)  # a model check's solve


# -- the model check -------------------------------------------------------------------


def test_sequence_losses_are_the_models_loss(tokenizer, calibration):
    """Each sequence's mean next-token loss, computed from the decoder and the LM head's
    weight, is what the model's own forward gives, also inside llmcompressor's
    calibration context (where the LM head's forward is disabled); an attention mask
    leaves out the masked tokens."""
    from llmcompressor.utils.helpers import calibration_forward_context

    model = load_model()
    sequences = [(torch.tensor(row["input_ids"]), None) for row in calibration.select(range(3))]
    expected = [float(model(input_ids=ids[None], labels=ids[None]).loss) for ids, _ in sequences]
    assert sequence_losses(model, sequences).tolist() == pytest.approx(expected, rel=1e-5)
    with calibration_forward_context(model):
        assert sequence_losses(model, sequences).tolist() == pytest.approx(expected, rel=1e-5)
    ids = sequences[0][0]
    mask = torch.ones_like(ids)
    mask[-10:] = 0  # right padding
    masked = sequence_losses(model, [(ids, mask)])
    short = float(model(input_ids=ids[None, :-10], labels=ids[None, :-10]).loss)
    assert masked.tolist() == pytest.approx([short], rel=1e-5)


def test_held_out_sequences_follow_the_global_index():
    batches = [{"input_ids": torch.arange(6).reshape(2, 3) + 10 * b} for b in range(3)]
    picked = held_out_sequences(batches, 0, lambda row: held_out_fold(row, 4))
    assert [int(ids[0]) for ids, _ in picked] == [13]  # global index 3 only
    shifted = held_out_sequences(batches, 3, lambda row: held_out_fold(row, 4))  # rank offset 3
    assert [int(ids[0]) for ids, _ in shifted] == [0, 20]  # global indices 3 and 7


@pytest.mark.parametrize("kept", ["chosen", "reference"])
def test_model_check_keeps_the_baseline_or_swaps_in_the_chosen_weights(
    run_oneshot, monkeypatch, kept
):
    """With the model check, a layer that leaves gamma 1 is solved and propagated at
    gamma 1, so the model after the last layer is Wanda's, bit for bit; the check then
    compares it with the chosen weights swapped in (losses forced here). Kept, the model
    is Wanda's; swapped, the modules that left gamma 1 carry the unchecked run's weights
    (with the least-error rule, layer 1 of stories260K leaves gamma 1 and, layer 0
    keeping it, is solved on the same inputs) and every other weight is Wanda's."""
    import whisper_modifiers.modifiers.model_check as model_check

    calls = []

    def forced(model, sequences, *start):
        calls.append(len(sequences))
        reference_first = len(calls) == 1
        lower = (kept == "reference") == reference_first
        return torch.full((len(sequences),), 1.0 if lower else 2.0, dtype=torch.float64)

    monkeypatch.setattr(model_check, "sequence_losses", forced)
    fields = {"gamma": "auto", "gamma_evidence": 0.0, **TWO_FOUR}
    unchecked = WispModifier(gamma_model_check=False, **fields)
    plain = linear_weights(run_oneshot([unchecked]))
    checked = WispModifier(**fields)
    weights = linear_weights(run_oneshot([checked]))
    assert calls == [2, 2]  # the held-out sequences (every 4th of 8), twice
    layer1 = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    first = [name for name, c in unchecked.gamma_selection().items() if c["gamma"] != 1.0][:2]
    assert first == layer1
    selection = checked.gamma_selection()
    moved = [name for name, choice in selection.items() if choice["chosen_gamma"] != 1.0]
    assert moved[:2] == layer1  # later layers see other inputs, so may choose otherwise
    for name in GATE_UP:
        choice = selection[name]
        assert ("model_check" in choice) == (name in moved)
        if name in moved:
            assert choice["model_check"]["kept"] == kept
            assert choice["gamma"] == (1.0 if kept == "reference" else choice["chosen_gamma"])
    assert [selection[n]["chosen_gamma"] for n in layer1] == [
        unchecked.gamma_selection()[n]["gamma"] for n in layer1
    ]
    wanda = linear_weights(run_oneshot([WandaPruningModifier(ignore=STOCK_IGNORE, **TWO_FOUR)]))
    if kept == "reference":
        assert_same_weights(weights, wanda)
        return
    assert_same_weights({name: weights[name] for name in layer1}, plain)
    assert_same_weights({n: w for n, w in weights.items() if n not in moved}, wanda)


@pytest.mark.parametrize(
    ("modifier", "options"),
    [
        (WispModifier, {}),
        (WispModifier, {"pipeline": "sequential"}),
        (WispPlusModifier, {"propagate_error": False}),  # Wisp keeps gamma 1 everywhere
    ],
)
def test_model_check_starts_from_the_propagated_hidden_states(
    run_oneshot, monkeypatch, modifier, options
):
    """The model check's passes start where the pipeline's propagation pass left the
    held-out sequences (the last layer for the baseline, the first deferred layer for the
    chosen weights) and give the losses of passes from the embeddings; without a
    propagation pass they start from the embeddings."""
    import whisper_modifiers.modifiers.model_check as model_check

    full_pass = model_check.sequence_losses
    starts = []

    def compared(model, sequences, skipped_layers=(), entering=()):
        starts.append(len(skipped_layers))
        losses = full_pass(model, sequences, skipped_layers, entering)
        assert losses.tolist() == pytest.approx(full_pass(model, sequences).tolist(), rel=1e-6)
        return losses

    monkeypatch.setattr(model_check, "sequence_losses", compared)
    checked = modifier(gamma="auto", gamma_evidence=0.0, **TWO_FOUR)
    run_oneshot([checked], **options)
    deferred = [
        int(name.split(".")[2])
        for name, choice in checked.gamma_selection().items()
        if choice["chosen_gamma"] != 1.0
    ]
    assert deferred and min(deferred) > 0
    propagated = options.get("propagate_error", True)
    assert starts == ([4, min(deferred)] if propagated else [0, 0])


def test_held_out_sequences_are_every_kth_global_index():
    assert [i for i in range(12) if held_out_fold(i, 4) is not None] == [3, 7, 11]
    assert [i for i in range(6) if held_out_fold(i, 2) is not None] == [1, 3, 5]
    assert [held_out_fold(i, 4, 2) for i in range(8)] == [None, None, 2, 3] * 2
    assert [held_out_fold(i, 3, 3) for i in range(6)] == [0, 1, 2] * 2
    tokens = torch.arange(12.0).unsqueeze(1)
    assert torch.equal(held_out_tokens(tokens, 7, 4), tokens)  # one fold: every token
    offsets = [int(held_out_tokens(tokens, i, 4, 4)[0]) for i in (3, 7, 11, 15, 19)]
    assert offsets == [0, 1, 2, 3, 0]  # cycling with the sequence's rank in its fold
    assert len(held_out_tokens(tokens, 7, 4, 4)) == 3


def test_auto_batch_size_does_not_change_the_choice(run_oneshot):
    one = WhisperModifier(gamma="auto", **TWO_FOUR)
    four = WhisperModifier(gamma="auto", **TWO_FOUR)
    run_oneshot([one])
    run_oneshot([four], batch_size=4)
    assert {n: c["gamma"] for n, c in one.gamma_selection().items()} == {
        n: c["gamma"] for n, c in four.gamma_selection().items()
    }


@pytest.mark.parametrize(
    "ours", [WispModifier, WispPlusModifier, WhisperModifier], ids=lambda c: c.__name__
)
def test_k_fold_auto_measures_every_fold(run_oneshot, ours):
    """``gamma_folds: 4`` measures each candidate on all four folds, each pruned with the
    other three folds' statistics: four per-fold choices per module, one pooled choice
    (``choose_gamma`` over every sequence's errors), and the same choice whatever the
    batch size."""
    one = ours(gamma="auto", gamma_folds=4, **TWO_FOUR)
    four = ours(gamma="auto", gamma_folds=4, **TWO_FOUR)
    weights = linear_weights(run_oneshot([one]))
    assert_same_weights(weights, linear_weights(run_oneshot([four], batch_size=4)))
    selection = one.gamma_selection()
    assert selection == four.gamma_selection()
    assert sorted(selection) == sorted(GATE_UP)
    for choice in selection.values():
        assert len(choice["fold_gammas"]) == 4
        assert choice["chosen_gamma"] == choose_gamma(
            {float(g): e for g, e in choice["held_out_error"].items()},
            {float(g): se for g, se in choice["difference_se"].items()},
            one.gamma_evidence,
        )


@pytest.mark.parametrize(
    ("ours", "stock"),
    [(WhisperModifier, SparseGPTModifier), (WispModifier, WandaPruningModifier)],
)
def test_k_fold_final_solve_sees_every_sequence(run_oneshot, ours, stock):
    """Every fold joins the statistics of the final solve: with one candidate the model
    is the fixed-gamma model, and with gamma 1 everywhere the baseline, bit for bit."""
    auto = run_oneshot([ours(gamma="auto", gamma_folds=4, gamma_candidates=[0.3], **TWO_FOUR)])
    fixed = run_oneshot([ours(gamma=0.3, **TWO_FOUR)])
    assert_same_weights(linear_weights(auto), linear_weights(fixed))
    kept = ours(gamma="auto", gamma_folds=2, gamma_evidence=1e9, **TWO_FOUR)
    model = run_oneshot([kept])
    assert {choice["gamma"] for choice in kept.gamma_selection().values()} == {1.0}
    baseline = run_oneshot([stock(ignore=STOCK_IGNORE, **TWO_FOUR)])
    assert_same_weights(linear_weights(model), linear_weights(baseline))


def test_k_fold_errors_are_the_slow_fold_loop(run_oneshot, monkeypatch):
    """Each fold's candidates are pruned with exactly the statistics of the other
    sequences: Wisp's channel statistic of fold ``f`` equals a direct sum over the
    sequences outside ``f`` (the loop reference), for every fold."""
    seen = []
    original = WispModifier.candidate_weights

    def recording(self, group, gammas):
        gate = group[0]
        if self._module_names[gate] == "model.layers.0.mlp.gate_proj" and len(gammas) > 1:
            seen.append(self._statistics[gate].plain_norms.total.clone())
        return original(self, group, gammas)

    monkeypatch.setattr(WispModifier, "candidate_weights", recording)
    model = load_model()
    name = f"{LAYER0}.mlp.gate_proj"
    inputs = record_inputs(model, [name])
    run_oneshot([WispModifier(gamma="auto", gamma_folds=4, **TWO_FOUR)], model=model)
    recorded = inputs[name][: 2 * NUM_SEQUENCES]  # a model check's forwards come after
    sequences = [x[0] for x in calibration_inputs(recorded)]
    assert len(seen) == 4
    for fold, statistic in enumerate(seen):
        others = [[x] for i, x in enumerate(sequences) if i % 4 != fold]
        assert torch.allclose(statistic, loop_channel_norms(others).float(), rtol=1e-5)


def _constructed_gated_mlp(offsets_fit, offsets_held, seed=0):
    """A gated MLP (m=32 -> n=64 -> d=16) and its inputs: 48 fit and 8 held-out
    sequences of 64 tokens, token noise 0.3 plus an offset on one channel of every group
    of four (``offsets_*()`` gives each sequence's)."""
    generator = torch.Generator().manual_seed(seed)
    m, n, d, tokens = 32, 64, 16, 64
    gate, up = torch.randn(n, m, generator=generator), torch.randn(n, m, generator=generator)
    down = torch.randn(d, n, generator=generator)
    channels = torch.zeros(m)
    channels[::4] = 1

    def sequences(count, offsets):
        return [
            0.3 * torch.randn(tokens, m, generator=generator) + offsets(generator) * channels
            for _ in range(count)
        ]

    return (gate, up, down), sequences(48, offsets_fit), sequences(8, offsets_held)


def _choose(weights, fit, held, candidates, evidence, criterion="relative"):
    """Whisper's gamma: auto on one constructed gated MLP, with the package's pieces:
    statistics of the fit sequences, SparseGPT's solve with H~ per candidate, and the
    held-out MLP output error."""
    gate, up, down = weights
    m = gate.shape[1]
    hessian = difference_hessian = None
    for index, x in enumerate(fit):
        hessian = add_sequence_grams(hessian, x)
        pairs = pairwise_differences(x, pair_permutations(x.shape[0], 1, (0, 0, index)))
        difference_hessian = add_sequence_grams(difference_hessian, pairs)
    hessian = mean_over_sequences(hessian, len(fit), 2.0)
    difference_hessian = mean_over_sequences(difference_hessian, len(fit), 2.0)

    def prune(gammas):
        return [prune_one(gamma) for gamma in gammas]

    def prune_one(gamma):
        mixed = regularized_difference_hessian(hessian, difference_hessian, gamma)
        pruned = {}
        for name, weight in (("gate", gate), ("up", up)):
            layer = torch.nn.Linear(m, weight.shape[0], bias=False)
            layer.weight.data.copy_(weight)
            pruned[name] = sparsify_weight(
                layer, {layer: mixed.clone()}, 0.5, 2, 4, 128, 0.01, False
            )[1]
        return pruned

    pairs = [(pruned["gate"], pruned["up"]) for pruned in prune(candidates)]
    best, errors, *_ = select_gamma(
        candidates, [gated_mlp_errors(held, gate, up, down, F.silu, pairs, criterion)], evidence
    )
    return best, errors


def test_auto_finds_the_known_gamma_on_a_constructed_layer():
    """Two layers where the right gamma is known.

    * Every sequence, held out or not, carries the same large offset on a quarter of the
      channels: the difference Hessian cannot see it (it cancels in every pair), so
      pruning by it drops the weights that carry the offset. The plain Hessian, gamma = 1
      (SparseGPT), is right.
    * Each fit sequence carries its own random offset there, and held-out sequences none:
      the plain Hessian spends the 2:4 budget on offsets that do not come back. The
      difference Hessian (offsets cancel within a sequence) describes the held-out
      sequences, so gamma = 0 is right.
    """
    candidates = [0.0, 0.1, 0.3, 1.0]
    evidence = WhisperModifier.model_fields["gamma_evidence"].default
    for seed in range(3):
        weights, fit, held = _constructed_gated_mlp(lambda g: 3.0, lambda g: 3.0, seed)
        best, errors = _choose(weights, fit, held, candidates, evidence)
        assert best == 1.0, errors
        assert errors[1.0] < 0.8 * errors[0.3], errors
        weights, fit, held = _constructed_gated_mlp(
            lambda g: 5.0 * torch.randn(32, generator=g), lambda g: 0.0, seed
        )
        best, errors = _choose(weights, fit, held, candidates, evidence)
        assert best == 0.0, errors
        assert errors[0.0] < 0.8 * errors[1.0], errors


def test_within_noise_the_baseline_stays_whatever_the_seed():
    """A constructed layer where the candidates differ, but by less than their noise:
    the fit sequences carry random offsets on a quarter of the channels (so gamma = 1
    and gamma < 1 keep different weights), and the held-out sequences alternate between
    no offset (where gamma < 1 errs less) and an offset (where gamma = 1 does). Their
    mean errors differ by up to 25 %, but the paired per-sequence differences swing
    both ways (at most 1.8 standard errors here): the default rule keeps gamma = 1 in
    every seed, while the plain least-error rule leaves it in most."""
    candidates = [0.0, 0.1, 0.3, 1.0]
    defaults = WhisperModifier.model_fields
    evidence, criterion = defaults["gamma_evidence"].default, defaults["gamma_criterion"].default
    chosen, least_error = [], []
    for seed in range(10):
        for rule, choices in ((evidence, chosen), (0.0, least_error)):
            held_offsets = iter([2.0 * (i % 2) for i in range(8)])
            weights, fit, held = _constructed_gated_mlp(
                lambda g: 5.0 * torch.randn(32, generator=g),
                lambda g, offsets=held_offsets: next(offsets),
                seed,
            )
            choices.append(_choose(weights, fit, held, candidates, rule, criterion)[0])
    assert chosen == [1.0] * 10
    assert sum(gamma != 1.0 for gamma in least_error) >= 5, least_error


def test_output_error_and_ties():
    x = [torch.eye(3)]
    weight = torch.arange(6.0).reshape(2, 3)
    pruned = weight * torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    absolute = output_errors(x + [2 * x[0]], weight, [pruned, weight], "absolute")
    assert absolute.tolist() == [[1.0 + 9.0, 4 * (1.0 + 9.0)], [0.0, 0.0]]
    # relative: per token (the rows of x[0]) ||e_t||^2 / ||W x_t||^2, averaged over tokens
    dense = x[0] @ weight.t()
    change = x[0] @ (weight - pruned).t()
    expected = (change.square().sum(1) / dense.square().sum(1)).mean()
    relative = output_errors(x + [2 * x[0]], weight, [pruned, weight])
    assert relative[0].tolist() == pytest.approx([float(expected)] * 2)  # scale-free
    assert relative[1].tolist() == [0.0, 0.0]
    gate, up, down = weight, weight.flip(0), torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    x = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0))]
    for criterion in ("absolute", "relative"):
        [[error]] = gated_mlp_errors(x, gate, up, down, F.silu, [(pruned, up)], criterion).tolist()
        dense = (F.silu(x[0] @ gate.t()) * (x[0] @ up.t())) @ down.t()
        change = dense - (F.silu(x[0] @ pruned.t()) * (x[0] @ up.t())) @ down.t()
        expected = change.square().sum()
        if criterion == "relative":
            expected = (change.square().sum(1) / dense.square().sum(1)).mean()
        assert error == pytest.approx(float(expected), rel=1e-5)
    assert choose_gamma({0.1: 2.0, 1.0: 2.0, 0.3: 3.0}) == 1.0  # a tie goes to the baseline


def test_paired_means_against_the_direct_formula():
    """Mean error per sequence and the standard error of the paired difference to the
    largest candidate, from sums that add over ranks: split the sequences in two and
    sum, and the result is the same."""
    generator = torch.Generator().manual_seed(0)
    errors = torch.rand(3, 7, generator=generator, dtype=torch.float64)  # [candidates, seqs]
    means, standard_errors = paired_means(paired_sums(errors, 2), 2)
    for c in range(3):
        difference = errors[c] - errors[2]
        assert means[c] == pytest.approx(float(errors[c].mean()), rel=1e-12)
        expected = float(difference.std(correction=1) / 7**0.5)
        assert standard_errors[c] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    split = paired_sums(errors[:, :3], 2) + paired_sums(errors[:, 3:], 2)
    split_means, split_standard_errors = paired_means(split, 2)
    assert split_means == pytest.approx(means) and split_standard_errors == pytest.approx(
        standard_errors
    )
    assert paired_means(paired_sums(errors[:, :1], 2), 2)[1] == [float("inf")] * 2 + [0.0]


def test_a_massive_token_decides_the_absolute_criterion_only():
    """One token with a 1000x larger output (an attention sink) where candidate A errs
    less, every other token where it errs more: the absolute sum follows the one token,
    the relative error the rest."""
    dense = torch.ones(8, 4, dtype=torch.float64)
    dense[0] *= 1000.0
    error_a = torch.full((8, 4), 0.2, dtype=torch.float64)
    error_a[0] = 10.0
    error_b = torch.full((8, 4), 0.1, dtype=torch.float64)
    error_b[0] = 20.0

    def better(criterion):
        a, b = (sequence_error(e, dense, criterion) for e in (error_a, error_b))
        return "a" if a < b else "b"

    assert better("absolute") == "a"
    assert better("relative") == "b"
    with pytest.raises(ValueError, match="criterion must be 'relative' or 'absolute'"):
        sequence_error(error_a, dense, "median")


def test_a_candidate_leaves_the_baseline_only_on_evidence():
    """Lower mean error than gamma 1 on noisy sequences is not enough with evidence 2;
    with evidence 0 the least error wins."""
    steady = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    noisy = torch.tensor([[0.0, 3.8, 0.0, 3.8], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)

    def choose(errors, evidence):
        best, *_ = select_gamma([0.3, 1.0], [errors], evidence)
        return best

    assert choose(steady, 2.0) == choose(steady, 0.0) == 0.3  # always better: chosen
    assert choose(noisy, 0.0) == 0.3  # better on average (1.9 < 2)...
    assert choose(noisy, 2.0) == 1.0  # ...but within noise: the baseline stays
    assert choose_gamma({0.1: 1.0, 1.0: 2.0}, {0.1: 0.4, 1.0: 0.0}, 2.0) == 0.1
    assert choose_gamma({0.1: 1.0, 1.0: 2.0}, {0.1: 0.5, 1.0: 0.0}, 2.0) == 1.0  # not beyond


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gamma": "best"}, "gamma"),
        ({"gamma": 1.5}, "gamma"),
        ({"gamma": 0.1, "gamma_candidates": [0.1, 1.0]}, "gamma_candidates applies to gamma"),
        ({"gamma": "auto", "gamma_candidates": [0.1, 0.1]}, "distinct values in"),
        ({"gamma": "auto", "gamma_candidates": []}, "non-empty list"),
        ({"gamma": "auto", "gamma_candidates": [2.0]}, "gamma_candidates"),
        ({"gamma": "auto", "holdout_every": 1}, "holdout_every"),
        ({"gamma": "auto", "gamma_folds": 0}, "gamma_folds"),
        ({"gamma": "auto", "gamma_folds": 5}, "gamma_folds must be between 1 and holdout_every"),
        ({"gamma": "auto", "gamma_evidence": -1.0}, "gamma_evidence"),
        ({"gamma": "auto", "gamma_criterion": "median"}, "gamma_criterion"),
        ({"gamma": "auto", "gamma_model_check": "maybe"}, "gamma_model_check"),
    ],
)
@pytest.mark.parametrize("ours", [WispModifier, WhisperModifier], ids=lambda c: c.__name__)
def test_bad_gamma_fields(ours, fields, message):
    with pytest.raises(ValueError, match=message):
        ours(**fields, **TWO_FOUR)


def test_auto_needs_a_held_out_sequence(run_oneshot, calibration):
    with pytest.raises(ValueError, match="holdout_every.*at least 4 sequences; got 3"):
        run_oneshot(
            [WhisperModifier(gamma="auto", **TWO_FOUR)], dataset=calibration.select(range(3))
        )


def test_whisper_prune_records_the_choices(tmp_path):
    from test_cli import FAST
    from whisper_modifiers.cli import main

    recipe = tmp_path / "auto.yaml"
    recipe.write_text(
        "sparsity_stage:\n  sparsity_modifiers:\n    WhisperModifier:\n"
        '      sparsity: 0.5\n      mask_structure: "2:4"\n      gamma: auto\n'
    )
    out = tmp_path / "out"
    assert main([*FAST, "--recipe", str(recipe), "--output-dir", str(out)]) == 0
    record = json.loads((out / "sparsity_record.json").read_text())
    assert sorted(record["gamma_selection"]) == sorted(GATE_UP)
    assert {c["gamma"] for c in record["gamma_selection"].values()} <= {0.01, 0.1, 0.3, 1.0}
