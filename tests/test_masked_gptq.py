"""GPTQ after pruning that keeps the mask (MaskedGPTQModifier), on a random layer and on
stories260K, against 2:4 + RTN and 2:4 + stock GPTQ (whose broken pattern is shown)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, fake_quantize
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
from llmcompressor.modifiers.quantization import QuantizationModifier

from conftest import CALIBRATION_TEXT, HELDOUT_TEXT, MODEL_DIR, group_32_recipe
from whisper_modifiers import MaskedGPTQModifier, WhisperModifier
from whisper_modifiers.cli import main as whisper_prune
from whisper_modifiers.evaluation import perplexity
from whisper_modifiers.modifiers.masked_gptq_quantize import masked_quantize_weight

CHANNEL_INT8 = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
# stories260K's Linear layers take 64 inputs (down_proj 172): groups of 32 quantize them
W4_GROUP32 = {
    "num_bits": 4,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "group_size": 32,
}


def random_problem(rows=24, columns=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator)
    x = torch.randn(4 * columns, columns, generator=generator) * torch.linspace(0.2, 3, columns)
    hessian = 2 * x.t() @ x / x.shape[0]
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return weight, hessian, scale


def two_four(weight: torch.Tensor) -> torch.Tensor:
    """Magnitude 2:4 mask applied to ``weight``."""
    groups = weight.reshape(weight.shape[0], -1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.abs().topk(2, dim=-1).indices, True)
    return (groups * keep).reshape(weight.shape)


def run(solver, weight, hessian, scale, blocksize=16):
    quantized, losses, fallback = solver(
        weight[None].clone(),
        hessian[None].clone(),
        scale[None],
        torch.zeros_like(scale)[None],
        None,
        CHANNEL_INT8,
        blocksize=blocksize,
    )
    assert not fallback.any()
    return quantized[0], losses[0]


def reference_masked_gptq(weight, hessian, scale, percdamp=0.01):
    """One column at a time, straight from the update rule (no blocks, explicit H^-1)."""
    W = weight.double().clone()
    H = hessian.double().clone()
    H += percdamp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    keep = weight != 0
    for i in range(W.shape[1]):
        q = fake_quantize(W[:, i : i + 1].float(), scale, torch.zeros_like(scale), CHANNEL_INT8)
        q = torch.where(keep[:, i : i + 1], q.double(), torch.zeros_like(q.double()))
        error = (W[:, i : i + 1] - q) / U[i, i]
        W[:, i : i + 1] = q
        W[:, i + 1 :] -= error * U[i : i + 1, i + 1 :]
    return W.float()


def test_dense_input_equals_stock_gptq_bit_for_bit():
    weight, hessian, scale = random_problem()
    ours, our_losses = run(masked_quantize_weight, weight, hessian, scale)
    stock, stock_losses = run(quantize_weight, weight, hessian, scale)
    assert torch.equal(ours, stock)
    assert torch.allclose(our_losses, stock_losses)


def test_the_mask_is_kept_exactly_and_matches_the_column_reference():
    weight, hessian, scale = random_problem()
    pruned = two_four(weight)
    ours, _ = run(masked_quantize_weight, pruned, hessian, scale)
    assert (ours[pruned == 0] == 0).all() and not torch.signbit(ours[pruned == 0]).any()
    groups = (ours != 0).reshape(ours.shape[0], -1, 4).sum(-1)
    assert (groups <= 2).all()
    reference = reference_masked_gptq(pruned, hessian, scale)
    # the same quantization grid point almost everywhere (fp32 blocks vs fp64 columns)
    assert (ours - reference).abs().le(1e-4).float().mean() > 0.99


def test_keeping_the_mask_costs_less_output_error_than_rounding():
    weight, hessian, scale = random_problem(seed=1)
    pruned = two_four(weight)
    ours, _ = run(masked_quantize_weight, pruned, hessian, scale)
    rounded = fake_quantize(pruned, scale, torch.zeros_like(scale), CHANNEL_INT8)

    def output_error(w):  # tr((W - Wp) H (W - Wp)^T): the layer-output error GPTQ reduces
        delta = w - pruned
        return float(torch.einsum("ij,jk,ik->", delta, hessian, delta))

    assert output_error(ours) < output_error(rounded)


def zero_groups_over_two(model) -> tuple[int, int]:
    bad = total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            groups = (module.weight != 0).reshape(module.weight.shape[0], -1, 4).sum(-1)
            bad += int((groups > 2).sum())
            total += groups.numel()
    return bad, total


def test_gptq_chain_keeps_two_four_and_is_compared_with_rtn_and_stock_gptq(run_oneshot, tokenizer):
    prune = dict(sparsity=0.5, mask_structure="2:4", seed=0)
    ignore = ["lm_head", "re:.*down_proj$"]
    groups = {"group_0": {"targets": ["Linear"], "weights": W4_GROUP32}}
    masked = run_oneshot(
        [WhisperModifier(**prune), MaskedGPTQModifier(config_groups=groups, ignore=ignore)]
    )
    rtn = run_oneshot(
        [WhisperModifier(**prune), QuantizationModifier(config_groups=groups, ignore=ignore)]
    )
    stock = run_oneshot(
        [GPTQModifier(config_groups=groups, ignore=ignore)],
        model=run_oneshot([WhisperModifier(**prune)]),
    )
    ids = tokenizer(HELDOUT_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    results = {}
    for label, model in [("masked GPTQ", masked), ("RTN", rtn), ("stock GPTQ", stock)]:
        bad, total = zero_groups_over_two(model)
        with torch.no_grad():
            ppl = perplexity(model.eval(), ids, 128, 8)
        results[label] = (ppl, bad, total)
    print(
        "\n2:4 + W4A16 (group 32) on stories260K: "
        + "; ".join(
            f"{k}: ppl {p:.2f}, groups with >2 nonzeros {b}/{t}" for k, (p, b, t) in results.items()
        )
    )
    assert results["masked GPTQ"][1] == 0 and results["RTN"][1] == 0
    assert results["stock GPTQ"][1] > 0  # the broken pattern
    assert results["masked GPTQ"][0] < results["RTN"][0]


def test_stock_gptq_after_pruning_is_refused(run_oneshot, tmp_path, capsys):
    with pytest.raises(ValueError, match="Use MaskedGPTQModifier"):
        stock = GPTQModifier(targets=["Linear"], scheme="W8A8", ignore=["lm_head"])
        run_oneshot([WhisperModifier(sparsity=0.5, mask_structure="2:4"), stock])
    recipe = tmp_path / "stock_gptq.yaml"
    recipe.write_text(
        "s_stage:\n  s_modifiers:\n    WispModifier:\n      sparsity: 0.5\n"
        "    GPTQModifier:\n      targets: ['Linear']\n      scheme: W8A8\n"
    )
    args = [
        "--model",
        str(MODEL_DIR),
        "--calibration",
        str(CALIBRATION_TEXT),
        "--eval-text",
        str(HELDOUT_TEXT),
        "--eval-seq-len",
        "128",
        "--recipe",
        str(recipe),
        "--output-dir",
        str(tmp_path / "o"),
    ]
    assert whisper_prune(args) == 2
    assert "Use MaskedGPTQModifier" in capsys.readouterr().err


@pytest.mark.parametrize("stem", ["whisper_2of4_gptq_w4a16", "wisp_plus_2of4_gptq_w4a16"])
def test_gptq_recipes_run(tmp_path, stem):
    from whisper_modifiers.checkpoint import load_checkpoint

    recipe = str(group_32_recipe(tmp_path, stem))  # groups of 128 divide no stories260K layer
    out = tmp_path / "ckpt"
    args = [
        "--model",
        str(MODEL_DIR),
        "--calibration",
        str(CALIBRATION_TEXT),
        "--eval-text",
        str(HELDOUT_TEXT),
        "--num-sequences",
        "4",
        "--seq-len",
        "64",
        "--eval-seq-len",
        "128",
        "--eval-windows",
        "2",
        "--skip-dense-eval",
        "--recipe",
        recipe,
        "--output-dir",
        str(out),
    ]
    assert whisper_prune(args) == 0
    assert zero_groups_over_two(load_checkpoint(out))[0] == 0
