"""Every recipe file end to end: oneshot on stories260K, save, reload, perplexity."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from llmcompressor.recipe import Recipe
from transformers import AutoModelForCausalLM

import whisper_modifiers
from conftest import HELDOUT_TEXT, MODEL_DIR, RECIPES, dense_state_dict, linear_weights
from whisper_modifiers.evaluation import perplexity

# pruning + quantization: tests/test_checkpoints.py, tests/test_masked_gptq.py
CHAINS = ("w8a8", "fp8", "w4a16", "gptq_w4a16")
RECIPE_FILES = sorted(p for p in RECIPES.glob("*.yaml") if not p.stem.endswith(CHAINS))
METHODS = [
    "magnitude",
    "wanda",
    "wisp",
    "wisp_plus",
    "sparsegpt",
    "whisper",
    "ria",
    "ria_wisp",
    "ria_wisp_plus",
    "alps",
    "alps_whisper",
]


AUTO = ("whisper", "wisp", "wisp_plus")  # gamma: auto at 2:4


def test_every_method_has_every_sparsity():
    names = {path.stem for path in RECIPE_FILES}
    assert names == {f"{m}_{s}" for m in METHODS for s in ("2of4", "50", "65")} | {
        f"{m}_auto_2of4" for m in AUTO
    }
    chains = {path.stem for path in RECIPES.glob("*.yaml")} - names
    two_four = {f"{m}_2of4_{q}" for m in ("whisper", "wisp_plus") for q in CHAINS}
    assert chains == two_four | {"whisper_50_w8a8", "whisper_65_w8a8", "wisp_plus_65_w8a8"}


def test_recipes_share_settings_with_their_baseline():
    def settings(stem):
        stage = yaml.safe_load((RECIPES / f"{stem}.yaml").read_text())["sparsity_stage"]
        ((_, fields),) = stage["sparsity_modifiers"].items()
        shared = ("sparsity", "mask_structure", "targets", "comparison_group", "dampening_frac")
        return {k: v for k, v in fields.items() if k in shared}

    for tag in ("2of4", "50", "65"):
        assert settings(f"wisp_{tag}") == settings(f"wanda_{tag}")
        assert settings(f"wisp_plus_{tag}") == settings(f"wanda_{tag}")
        assert settings(f"whisper_{tag}") == settings(f"sparsegpt_{tag}")
        assert settings(f"ria_wisp_{tag}") == settings(f"ria_{tag}")
        assert settings(f"ria_wisp_plus_{tag}") == settings(f"ria_{tag}")
        assert settings(f"alps_whisper_{tag}") == settings(f"alps_{tag}")
    for method in AUTO:
        assert settings(f"{method}_auto_2of4") == settings(f"{method}_2of4")


def test_unstructured_w8a8_chains_prune_as_their_unquantized_recipe():
    """``whisper_50_w8a8`` and the others: the pruning stage of their unquantized recipe,
    field for field, then llmcompressor's W8A8 over the same layers."""
    for stem in ("whisper_50", "whisper_65", "wisp_plus_65"):
        chain = yaml.safe_load((RECIPES / f"{stem}_w8a8.yaml").read_text())["sparsity_stage"]
        plain = yaml.safe_load((RECIPES / f"{stem}.yaml").read_text())["sparsity_stage"]
        assert chain["sparsity_modifiers"] == plain["sparsity_modifiers"]
        quantization = chain["quantization_modifiers"]["QuantizationModifier"]
        assert quantization["scheme"] == "W8A8"
        (pruning,) = plain["sparsity_modifiers"].values()
        assert quantization["ignore"] == pruning["ignore"]


def test_yaml_names_resolve_to_our_modifiers():
    recipe = Recipe.create_instance(str(RECIPES / "whisper_2of4.yaml"))
    (modifier,) = recipe.modifiers
    assert isinstance(modifier, whisper_modifiers.WhisperModifier)
    assert modifier.gamma == 0.01 and modifier.mask_structure == "2:4"


@pytest.fixture(scope="module")
def heldout(tokenizer):
    return tokenizer(HELDOUT_TEXT.read_text(encoding="utf-8"))["input_ids"]


def test_dense_perplexity_is_sane(heldout):
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    assert 1.5 < perplexity(model, heldout, seq_len=256) < 10  # ~3.6 on TinyStories


@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=lambda p: p.stem)
def test_recipe_end_to_end(run_oneshot, recipe, tmp_path, heldout):
    pruned = run_oneshot(str(recipe), output_dir=str(tmp_path / "out"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    weights, saved = linear_weights(pruned), dense_state_dict(reloaded)  # 2:4 kept compressed
    for name in weights:
        assert torch.equal(weights[name], saved[f"{name}.weight"]), name
    sparsity = yaml.safe_load(recipe.read_text())["sparsity_stage"]["sparsity_modifiers"]
    ((_, fields),) = sparsity.items()
    gate = saved["model.layers.2.mlp.gate_proj.weight"]
    assert abs((gate == 0).float().mean().item() - fields["sparsity"]) < 0.01
    ppl = perplexity(reloaded, heldout, seq_len=256)
    assert math.isfinite(ppl) and ppl > 1
