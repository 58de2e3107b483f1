"""llmcompressor's own save of a recipe with our modifiers (``oneshot(..., output_dir=D)``
and ``model.save_pretrained(D, save_compressed=True)``) writes what whisper-prune writes:
the compressed 2:4 layout, its record and the load-time guard, through one code path
(``saving.write_checkpoint``). stories260K, a few calibration sequences."""

from __future__ import annotations

import json

import pytest
import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.pruning import SparseGPTModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import whisper_modifiers  # noqa: F401  (our modifiers and the 2:4 format)
from conftest import MODEL_DIR, dense_state_dict, group_32_recipe
from whisper_modifiers import WhisperModifier, WispPlusModifier, saving
from whisper_modifiers.checkpoint import load_checkpoint
from whisper_modifiers.output_dir import OutputDirError
from whisper_sparse import QUANT_METHOD, NotTwoFourError
from whisper_sparse.format.checkpoint import RECORD_FILE, check_checkpoint
from whisper_sparse.format.declaration import STOCK_LOADER_GUARD

pytestmark = pytest.mark.slow


def run(recipe, calibration, tokenizer, output_dir=None, **kwargs):
    """``oneshot`` as a user calls it: a model directory, a dataset and a recipe."""
    return oneshot(
        model=str(MODEL_DIR),
        dataset=calibration,
        recipe=recipe,
        tokenizer=tokenizer,
        output_dir=None if output_dir is None else str(output_dir),
        shuffle_calibration_samples=False,
        **kwargs,
    )


def whisper_2of4():
    return WhisperModifier(sparsity=0.5, mask_structure="2:4")


def dense_bytes() -> int:
    return (MODEL_DIR / "model.safetensors").stat().st_size


def assert_compressed(directory, model, quantization_format=None):
    """``directory`` holds our compressed 2:4 layout of ``model``'s pruned Linear layers,
    with its record and guard, and reloads (after ``import whisper_modifiers``) as the
    model in memory, exactly 2:4."""
    config = json.loads((directory / "config.json").read_text())
    ours = config["quantization_config"]
    assert ours["quant_method"] == QUANT_METHOD
    assert config["transformers_weights"] == STOCK_LOADER_GUARD
    assert (ours.get("quantization_config") or {}).get("format") == quantization_format
    record = json.loads((directory / RECORD_FILE).read_text())
    assert record["layout"] == "compressed" and record["summary"]["patterns"] == ["2:4"]
    with safe_open(directory / "model.safetensors", "pt") as tensors:
        names = set(tensors.keys())
    assert "model.layers.0.mlp.gate_proj.compressed" in names
    assert "model.layers.0.mlp.gate_proj.weight" not in names
    return record


def test_oneshot_output_dir_saves_the_compressed_layout(tmp_path, calibration, tokenizer):
    out = tmp_path / "whisper-2of4"
    model = run([whisper_2of4()], calibration, tokenizer, out)
    assert_compressed(out, model)
    assert (out / "model.safetensors").stat().st_size < 0.9 * dense_bytes()
    assert (out / "tokenizer_config.json").is_file()  # oneshot saves the tokenizer after
    check_checkpoint(out)
    pruned = {k: v for k, v in model.state_dict().items()}
    for reloaded in (
        AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32),
        load_checkpoint(out),
    ):
        state = dense_state_dict(reloaded)  # a plain load keeps 2:4 compressed on a CPU
        assert state.keys() == pruned.keys()
        assert all(torch.equal(state[k], pruned[k]) for k in pruned)
    up = state["model.layers.2.mlp.up_proj.weight"]
    assert ((up == 0).reshape(up.shape[0], -1, 4).sum(-1) == 2).all()

    # afterwards, as llmcompressor's examples save: the same layout; and the dense one
    again, dense = tmp_path / "again", tmp_path / "dense"
    model.save_pretrained(again, save_compressed=True)
    assert_compressed(again, model)
    model.save_pretrained(dense, save_compressed=False)
    config = json.loads((dense / "config.json").read_text())
    assert (config.get("quantization_config") or {}).get("quant_method") != QUANT_METHOD
    assert json.loads((dense / RECORD_FILE).read_text())["layout"] == "uncompressed"
    with safe_open(dense / "model.safetensors", "pt") as tensors:
        assert "model.layers.0.mlp.gate_proj.weight" in set(tensors.keys())


CHAINS = [("W8A8", "int-quantized"), ("FP8_DYNAMIC", "float-quantized")]


@pytest.mark.parametrize(("scheme", "quantization_format"), CHAINS)
def test_quantized_chains_store_their_8_bit_values_compressed(
    tmp_path, calibration, tokenizer, scheme, quantization_format
):
    def recipe():
        quantize = QuantizationModifier(targets=["Linear"], scheme=scheme, ignore=["lm_head"])
        return [WispPlusModifier(sparsity=0.5, mask_structure="2:4"), quantize]

    out, dense = tmp_path / scheme, tmp_path / "dense"
    model = run(recipe(), calibration, tokenizer, out)
    assert_compressed(out, model, quantization_format)
    with safe_open(out / "model.safetensors", "pt") as tensors:
        compressed = tensors.get_tensor("model.layers.0.mlp.up_proj.compressed")
    assert compressed.element_size() == 1  # the 8-bit values, two of every four
    # llmcompressor's uncompressed save of the same run keeps the float weights: ours,
    # dequantized, are those to 8-bit precision, with their zeros, and 2:4
    run(recipe(), calibration, tokenizer, dense, save_compressed=False)
    assert json.loads((dense / RECORD_FILE).read_text())["layout"] == "uncompressed"
    reference = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for layer in ("model.layers.1.mlp.gate_proj.weight", "model.layers.4.self_attn.o_proj.weight"):
        ours, theirs = reloaded[layer], reference[layer]
        assert (ours[theirs == 0] == 0).all(), layer  # pruned stays pruned
        assert float((ours - theirs).norm() / theirs.norm()) < 0.05, layer
        assert ((ours == 0).reshape(ours.shape[0], -1, 4).sum(-1) >= 2).all()


@pytest.mark.parametrize(("sparsity", "mask_structure"), [(0.5, "0:0"), (0.75, "3:4")])
def test_other_sparsity_is_saved_in_the_bitmask_layout(
    tmp_path, calibration, tokenizer, sparsity, mask_structure
):
    """Unstructured and N:M other than 2:4: every pruned Linear in the bitmask layout
    (values, bitmask, row offsets), through oneshot's output_dir and save_pretrained alike,
    reloading as the model in memory; a W8A8 chain stores its 8-bit values so."""
    out = tmp_path / "out"
    model = run(
        [WhisperModifier(sparsity=sparsity, mask_structure=mask_structure)],
        calibration,
        tokenizer,
        out,
    )
    again = tmp_path / "again"
    model.save_pretrained(again)
    pruned = model.state_dict()
    for directory in (out, again):
        declared = json.loads((directory / "config.json").read_text())["quantization_config"]
        assert declared["quant_method"] == QUANT_METHOD and declared["format"] == "sparse-bitmask"
        assert "model.layers.2.mlp.up_proj" in declared["bitmask_targets"]
        assert "lm_head" not in declared["bitmask_targets"] and not declared["targets"]
        record = json.loads((directory / RECORD_FILE).read_text())
        assert record["layout"] == "compressed"
        reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        state = dense_state_dict(reloaded)
        assert state.keys() == pruned.keys()
        assert all(torch.equal(state[k], pruned[k]) for k in pruned)
    quantized = tmp_path / "w8a8"
    run(
        [
            WhisperModifier(sparsity=sparsity, mask_structure=mask_structure),
            QuantizationModifier(targets=["Linear"], scheme="W8A8", ignore=["lm_head"]),
        ],
        calibration,
        tokenizer,
        quantized,
    )
    with safe_open(quantized / "model.safetensors", "pt") as tensors:
        values = tensors.get_tensor("model.layers.0.mlp.up_proj.compressed")
    assert values.dtype == torch.int8 and values.dim() == 1
    assert load_checkpoint(quantized).model.layers[0].mlp.up_proj.weight.count_nonzero() <= (
        values.numel()
    )


def test_w4a16_chain_keeps_compressed_tensors_packed_format(tmp_path, calibration, tokenizer):
    from llmcompressor.recipe import Recipe

    recipe = Recipe.create_instance(str(group_32_recipe(tmp_path, "whisper_2of4_w4a16")))
    out = tmp_path / "w4a16"
    run(recipe.modifiers, calibration, tokenizer, out)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert "transformers_weights" not in config
    record = json.loads((out / RECORD_FILE).read_text())
    assert (
        record["layout"] == "dense"
        and record["layers"]["model.layers.0.mlp.up_proj"]["pattern"] == "2:4"
    )
    up = load_checkpoint(out).model.layers[0].mlp.up_proj.weight
    assert ((up == 0).reshape(up.shape[0], -1, 4).sum(-1) >= 2).all()


def test_stock_modifiers_alone_save_what_llmcompressor_saves(tmp_path, calibration, tokenizer):
    """Importing this package does not change what a recipe of llmcompressor's own
    modifiers writes: their 2:4 checkpoint stays dense, with no record."""
    out = tmp_path / "stock"
    run(
        [
            SparseGPTModifier(
                sparsity=0.5, mask_structure="2:4", targets=["Linear"], ignore=["re:.*lm_head"]
            )
        ],
        calibration,
        tokenizer,
        out,
    )
    config = json.loads((out / "config.json").read_text())
    assert (config.get("quantization_config") or {}).get("quant_method") != QUANT_METHOD
    assert not (out / RECORD_FILE).exists()


def test_the_save_is_installed_through_on_finalize_not_a_patch(tmp_path, calibration, tokenizer):
    """The save comes from our modifiers' own ``on_finalize`` (``finalize_hook``), with the
    whole recipe's modifiers: llmcompressor's lifecycle is left as the library wrote it, and
    a model our modifiers did not finalize keeps the save llmcompressor gave it."""
    from llmcompressor.core.lifecycle import CompressionLifecycle

    assert CompressionLifecycle.finalize.__module__ == "llmcompressor.core.lifecycle"
    assert not hasattr(CompressionLifecycle.finalize, saving._INSTALLED)
    recipe = [
        whisper_2of4(),
        QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    ]
    model = run(recipe, calibration, tokenizer)
    installed = getattr(model.save_pretrained, saving._INSTALLED)
    assert [type(m) for m in installed["modifiers"]] == [WhisperModifier, QuantizationModifier]
    stock = run(
        [
            SparseGPTModifier(
                sparsity=0.5, mask_structure="2:4", targets=["Linear"], ignore=["re:.*lm_head"]
            )
        ],
        calibration,
        tokenizer,
    )
    assert not hasattr(stock.save_pretrained, saving._INSTALLED)


def test_a_failed_save_leaves_nothing_and_checks_come_first(
    tmp_path, calibration, tokenizer, monkeypatch
):
    model = run([whisper_2of4()], calibration, tokenizer)
    # interrupted while writing the 2:4 layout: no directory, no partial one
    out = tmp_path / "interrupted"

    def interrupted(directory, *layers):
        raise KeyboardInterrupt

    monkeypatch.setattr(saving, "write_compressed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(out)
    assert not list(tmp_path.iterdir())
    monkeypatch.undo()

    # a layer that is not exactly 2:4: refused before anything is written
    with torch.no_grad():
        model.model.layers[3].mlp.up_proj.weight[5, :4] = 1.0
    with pytest.raises(NotTwoFourError, match="model.layers.3.mlp.up_proj is not exactly 2:4"):
        model.save_pretrained(out)
    assert not list(tmp_path.iterdir())

    # a directory this package did not write is never replaced; the source model neither
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not empty and was not written by"):
        model.save_pretrained(foreign)
    with pytest.raises(OutputDirError, match="an input of this run"):
        model.save_pretrained(MODEL_DIR)
    assert (foreign / "notes.txt").read_text() == "mine"
