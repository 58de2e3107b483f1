"""MoE experts get the difference statistic with pairs formed within each calibration
sequence's tokens routed to the expert (``modifiers.moe_routing``): against a slow
reference written from the paper's equations on a tiny random Qwen3-MoE, whatever the
batch size and whether llmcompressor hands an expert every token or its routed ones."""

from __future__ import annotations

import zlib

import pytest
import torch
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from reference import loop_differences, loop_neuronwise
from whisper_modifiers import WhisperModifier, WispModifier, WispPlusModifier
from whisper_modifiers.modifiers.moe_routing import MoERouting
from whisper_modifiers.statistics import pair_permutations
from whisper_sparse.format.two_four import check_two_four

pytestmark = pytest.mark.slow
NUM_EXPERTS = 16  # one routed expert per token: some get fewer than 2 tokens of a sequence
GATE = "model.layers.0.mlp.experts.{}.gate_proj"


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("qwen3moe")
    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=1,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prune(source, tokenizer, calibration, recipe, **options):
    return oneshot(
        model=str(source),
        dataset=calibration,
        tokenizer=tokenizer,
        recipe=[recipe],
        shuffle_calibration_samples=False,
        **options,
    )


def routed_tokens(source, calibration) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(MoE block input [s, h], top-k experts [s, k])`` of layer 0 for each calibration
    sequence, from plain transformers (fused experts, one sequence at a time)."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    block, seen = model.model.layers[0].mlp, {}
    block.register_forward_pre_hook(lambda _, args: seen.update(x=args[0][0]))
    block.gate.register_forward_hook(lambda _, __, output: seen.update(experts=output[2]))
    sequences = []
    with torch.no_grad():
        for ids in calibration["input_ids"]:
            model(torch.tensor([ids]))
            sequences.append((seen["x"].clone(), seen["experts"].clone()))
    return sequences


def reference_pairs(sequences, expert: int):
    """Each sequence's pairwise differences among its tokens routed to ``expert``
    (paper Section 3.1, one pair at a time), and how many sequences had fewer than 2."""
    seed = (0, zlib.crc32(GATE.format(expert).encode()))
    differences, skipped = [], 0
    for row, (x, experts) in enumerate(sequences):
        positions = [t for t in range(x.shape[0]) if expert in experts[t].tolist()]
        if len(positions) < 2:
            skipped += 1
            continue
        permutation = pair_permutations(len(positions), 1, (*seed, row))
        differences.append(loop_differences(x[positions], permutation))
    return differences, skipped


def two_four_kept(weight: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The 2:4 mask keeping the 2 highest scores of every 4 consecutive inputs."""
    groups = scores.reshape(scores.shape[0], -1, 4)
    kept = torch.zeros_like(groups, dtype=torch.bool)
    kept.scatter_(2, groups.topk(2, dim=2).indices, True)
    return kept.reshape(weight.shape)


@pytest.mark.parametrize("method", ["wisp", "wisp_plus"])
def test_expert_masks_equal_the_slow_reference(moe_source, tokenizer, calibration, method):
    """Layer 0's experts (inputs the dense model's): Wisp's ``|W_ij| ||dX_j||`` and
    Wisp+'s ``|W_ij| a_ij`` over the pairs of each sequence's routed tokens only."""
    recipe = (WispModifier if method == "wisp" else WispPlusModifier)(
        sparsity=0.5, mask_structure="2:4"
    )
    dense = AutoModelForCausalLM.from_pretrained(moe_source, dtype=torch.float32)
    pruned = prune(moe_source, tokenizer, calibration, recipe)  # the sequential pipeline
    sequences = routed_tokens(moe_source, calibration)
    fused, width = dense.model.layers[0].mlp.experts, 64
    experts = range(NUM_EXPERTS) if method == "wisp" else range(4)  # Wisp+'s loops are slow
    skips = recipe.routing_skips()
    assert sum(skipped for skipped, _ in skips.values()) > 0  # the case is exercised
    for expert in experts:
        differences, skipped = reference_pairs(sequences, expert)
        assert skips[GATE.format(expert)] == (skipped, len(sequences))
        for offset, part in ((0, "gate_proj"), (width, "up_proj")):
            weight = fused.gate_up_proj[expert, offset : offset + width].detach().double()
            if method == "wisp":
                statistic = sum(d.square().sum(0) for d in differences).sqrt()
            else:
                statistic = sum(
                    loop_neuronwise(weight, d, recipe.pair_fraction)
                    for d in differences
                    if d.abs().sum() > 0
                )
            kept = two_four_kept(weight, weight.abs() * statistic)
            module = getattr(pruned.model.layers[0].mlp.experts[expert], part)
            assert torch.equal(module.weight != 0, kept), f"expert {expert} {part}"


def expert_weights(model) -> dict[str, torch.Tensor]:
    return {
        name: parameter.detach().clone()
        for name, parameter in model.named_parameters()
        if ".experts." in name
    }


@pytest.mark.parametrize(
    "options",
    [dict(batch_size=4), dict(moe_calibrate_all_experts=False)],
    ids=["batch_size_4", "routed_tokens_only"],
)
def test_pairs_depend_on_neither_batch_size_nor_what_experts_receive(
    moe_source, tokenizer, calibration, options
):
    """Four sequences a batch, or experts calibrated on their routed tokens only
    (``moe_calibrate_all_experts: false``): the same pairs, so Wisp's gate and up masks
    and the skip counts are those of one sequence a batch with every token."""
    recipe, other = (
        WispModifier(sparsity=0.5, mask_structure="2:4"),
        WispModifier(sparsity=0.5, mask_structure="2:4"),
    )
    masks = {
        n: w != 0
        for n, w in expert_weights(prune(moe_source, tokenizer, calibration, recipe)).items()
    }
    again = expert_weights(prune(moe_source, tokenizer, calibration, other, **options))
    # layer 0 only: a later layer's routing follows the earlier layers' outputs, which
    # llmcompressor computes with other GEMM shapes in these settings (a routing near-tie
    # may flip)
    first = [
        name
        for name in masks
        if name.startswith("model.layers.0.") and not name.endswith("down_proj.weight")
    ]  # Wanda's: over what it receives
    skips = {
        name: counts
        for name, counts in recipe.routing_skips().items()
        if name.startswith("model.layers.0.")
    }
    assert {name: other.routing_skips()[name] for name in skips} == skips
    assert first
    for name in first:
        assert torch.equal(again[name] != 0, masks[name]), name


@pytest.mark.parametrize("method", [WhisperModifier, WispModifier, WispPlusModifier])
def test_experts_without_pairs_fall_back_to_the_baseline(
    moe_source, tokenizer, calibration, method
):
    """An expert that no sequence sends 2 tokens (one-token sequences) has no difference
    statistic: it is pruned with the baseline's (SparseGPT's H, Wanda's ||X_j||), with a
    warning: the weights of gamma 1, to exact 2:4."""
    short = calibration.map(
        lambda row: {"input_ids": row["input_ids"][:1], "attention_mask": row["attention_mask"][:1]}
    )
    recipe = method(sparsity=0.5, mask_structure="2:4")
    model = prune(moe_source, tokenizer, short, recipe)
    skips = recipe.routing_skips()
    assert skips and all(skipped == total for skipped, total in skips.values())
    baseline = (WispModifier if method is WispPlusModifier else method)(
        sparsity=0.5, mask_structure="2:4", gamma=1.0
    )
    expected = expert_weights(prune(moe_source, tokenizer, short, baseline))
    for name, weight in expert_weights(model).items():
        assert torch.equal(weight, expected[name]), name
        check_two_four(weight, name)


def test_pairs_that_vanish_count_as_none(moe_source, tokenizer, calibration):
    """Two-token sequences: an expert sent both tokens of a sequence may draw the identity
    permutation, whose differences are all zero; such a sequence adds nothing, and an
    expert left with nothing else falls back to H (no "difference Hessian is zero")."""
    pair = calibration.map(
        lambda row: {"input_ids": row["input_ids"][:2], "attention_mask": row["attention_mask"][:2]}
    )
    model = prune(moe_source, tokenizer, pair, WhisperModifier(sparsity=0.5, mask_structure="2:4"))
    for name, weight in expert_weights(model).items():
        check_two_four(weight, name)


@pytest.mark.parametrize(
    "fields", [dict(gamma="auto"), dict(pairing="centered")], ids=["gamma_auto", "centered"]
)
def test_expert_settings_without_routed_pairs_are_refused(
    moe_source, tokenizer, calibration, fields
):
    with pytest.raises(
        ValueError,
        match=r"not available for MoE experts and the shared experts of MoE blocks \(model\.",
    ):
        prune(
            moe_source,
            tokenizer,
            calibration,
            WhisperModifier(sparsity=0.5, mask_structure="2:4", **fields),
        )


def test_experts_whose_routing_cannot_be_followed_are_refused():
    """Experts outside llmcompressor's LinearExperts2D: named, before calibration."""
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = torch.nn.ModuleList([torch.nn.Module()])
    model.mlp.experts[0].gate_proj = torch.nn.Linear(8, 8)
    refused = r"mlp\.experts\.0\.gate_proj is an MoE expert of a ModuleList, whose routing"
    with pytest.raises(ValueError, match=refused):
        MoERouting().watch(
            model,
            [("mlp.experts.0.gate_proj", model.mlp.experts[0].gate_proj)],
            lambda *args, **kwargs: None,
        )


def test_flattened_block_input_refuses_the_batch(moe_source):
    """A block fed ``[tokens, hidden]`` cannot tell its sequences apart: refused, naming
    the batch size that works."""
    from llmcompressor.modeling.moe.linearize import linearize_moe

    model = linearize_moe(AutoModelForCausalLM.from_pretrained(moe_source, dtype=torch.float32))
    gate = model.model.layers[0].mlp.experts[0].gate_proj
    routing = MoERouting()
    routing.watch(model, [(GATE.format(0), gate)], lambda *args, **kwargs: None)
    routing._record_shape(model.model.layers[0].mlp, (torch.zeros(6, 64),), {})
    with pytest.raises(ValueError, match="calibrate with batch_size: 1"):
        routing.batch_size(gate)
