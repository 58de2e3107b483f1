"""Pruning chained with quantization, the checkpoint record, and checkpoint checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    CALIBRATION_TEXT,
    HELDOUT_TEXT,
    MODEL_DIR,
    RECIPES,
    group_32_recipe,
    legacy_sparse_checkpoint,
)
from whisper_modifiers.checkpoint import load_checkpoint
from whisper_modifiers.cli import main
from whisper_modifiers.quantization import chained_recipe, indivisible_layers
from whisper_sparse import QUANT_METHOD
from whisper_sparse.format.checkpoint import RECORD_FILE, check_checkpoint
from whisper_sparse.format.declaration import BITMASK_FORMAT
from whisper_sparse.format.layout import decompress_stored

FAST = [
    "--model",
    str(MODEL_DIR),
    "--calibration",
    str(CALIBRATION_TEXT),
    "--num-sequences",
    "4",
    "--seq-len",
    "64",
    "--eval-text",
    str(HELDOUT_TEXT),
    "--eval-seq-len",
    "128",
    "--eval-windows",
    "2",
    "--skip-dense-eval",
]


@pytest.mark.parametrize(
    ("recipe", "quant_format"),
    [
        ("whisper_2of4_w8a8", "int-quantized"),
        ("whisper_2of4_fp8", "float-quantized"),
        ("wisp_plus_2of4_w8a8", "int-quantized"),
        ("wisp_plus_2of4_fp8", "float-quantized"),
    ],
)
@pytest.mark.parametrize("layout", ["compressed", "dense"])
def test_chain_keeps_two_four_after_quantization(tmp_path, recipe, quant_format, layout):
    out = tmp_path / "ckpt"
    assert main([*FAST, "--recipe", recipe, "--layout", layout, "--output-dir", str(out)]) == 0
    config = check_checkpoint(out)
    quantization = config["quantization_config"]
    if layout == "compressed":  # 8-bit values compressed, compressed-tensors' config nested
        assert quantization["quant_method"] == QUANT_METHOD
        quantization = quantization["quantization_config"]
    assert quantization["format"] == quant_format
    assert not quantization.get("sparsity_config")  # vLLM refuses targets
    model = load_checkpoint(out)  # dequantizes
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            groups = (module.weight == 0).reshape(module.weight.shape[0], -1, 4).sum(-1)
            assert (groups >= 2).all(), name  # the 2:4 pattern survived quantization
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["summary"]["patterns"] == ["2:4"]
    assert record["layers"]["lm_head"]["pattern"] == "dense"
    report = json.loads((out / "whisper_prune_report.json").read_text())
    assert math.isfinite(report["pruned_perplexity"])


@pytest.mark.parametrize(
    ("recipe", "sparsity"),
    [("whisper_50_w8a8", 0.5), ("whisper_65_w8a8", 0.65), ("wisp_plus_65_w8a8", 0.65)],
)
def test_unstructured_w8a8_stores_its_int8_values_in_the_bitmask_layout(tmp_path, recipe, sparsity):
    """Every pruned layer's kept int8 values, a bit per input and the row offsets, the
    scales as compressed-tensors writes them; decompressed, the dense layout's int8 weights
    bit for bit (the same pruning and quantization), and both load to the same model."""
    compressed, dense = tmp_path / "compressed", tmp_path / "dense"
    for layout, out in (("compressed", compressed), ("dense", dense)):
        argv = [*FAST, "--recipe", recipe, "--layout", layout, "--output-dir", str(out)]
        assert main(argv) == 0
    declared = check_checkpoint(compressed)["quantization_config"]
    assert declared["quant_method"] == QUANT_METHOD
    assert (declared["format"], declared["sparsity_structure"]) == (BITMASK_FORMAT, "unstructured")
    assert declared["quantization_config"]["format"] == "int-quantized"
    assert declared["targets"] == [] and len(declared["bitmask_targets"]) == 7 * 5
    stored = load_file(compressed / "model.safetensors")
    reference = load_file(dense / "model.safetensors")
    for name in declared["bitmask_targets"]:
        values = stored[f"{name}.compressed"]
        assert values.dtype == torch.int8 and values.dim() == 1 and f"{name}.weight" not in stored
        parts = (f"{name}.{part}" for part in ("bitmask", "row_offsets", "shape"))
        weight = decompress_stored(values, *(stored[part] for part in parts), name)
        assert torch.equal(weight, reference[f"{name}.weight"]), name
        assert torch.equal(stored[f"{name}.weight_scale"], reference[f"{name}.weight_scale"])
        assert (weight == 0).float().mean() >= sparsity - 0.01, name
    assert (compressed / "model.safetensors").stat().st_size < (
        dense / "model.safetensors"
    ).stat().st_size
    record = json.loads((compressed / RECORD_FILE).read_text())
    assert record["summary"]["patterns"] == ["unstructured"]
    ours, theirs = load_checkpoint(compressed).state_dict(), load_checkpoint(dense).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_w4a16_that_would_quantize_nothing_is_refused(tmp_path, run_oneshot, capsys):
    # oneshot on the YAML alone: llmcompressor's own error names every layer to ignore
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj"):
        run_oneshot(str(RECIPES / "whisper_2of4_w4a16.yaml"))
    # whisper-prune keeps such layers in 16-bit (tests/test_serving.py: SmolLM2's 576-input
    # ones); on stories260K that is every layer, so the run would quantize nothing: refused
    # before any weight loads, naming the recipe, the modifier and the scheme
    for stem in ("whisper_2of4_w4a16", "whisper_2of4_gptq_w4a16"):
        out = tmp_path / stem
        assert main([*FAST, "--recipe", stem, "--output-dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{stem}.yaml: " in err and "(W4A16) would quantize no layer" in err
        assert not out.exists()


def test_indivisible_layers():
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(576, 1536))
    model.add_module("down", torch.nn.Linear(1536, 576))
    model.add_module("small", torch.nn.Linear(64, 64))
    assert indivisible_layers(model, "W4A16") == ["up", "small"]
    assert indivisible_layers(model, "W8A8") == []
    recipe = chained_recipe("whisper", "W4A16", model)
    assert recipe[1].ignore == ["lm_head", "up", "small"]
    assert recipe[1].resolved_config.ignore == ["lm_head", "up", "small"]


def test_legacy_sparse_format_loads_or_is_refused_with_a_way_out(tmp_path):
    legacy = legacy_sparse_checkpoint(tmp_path / "legacy")  # unquantized: the same tensors
    check_checkpoint(legacy)
    model = load_checkpoint(legacy)
    gate = model.model.layers[0].mlp.gate_proj.weight
    assert ((gate != 0).reshape(gate.shape[0], -1, 4).sum(-1) == 2).all()
    quantized = legacy_sparse_checkpoint(tmp_path / "quantized", quantized=True)
    with pytest.raises(ValueError, match="legacy 'sparse-24-bitmask'.*compressed-tensors<0.15"):
        check_checkpoint(quantized)
    with pytest.raises(ValueError, match="legacy"):
        load_checkpoint(quantized)


def test_incomplete_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        check_checkpoint(tmp_path)
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        check_checkpoint(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        check_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "whisper_prune_report.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{RECORD_FILE} is missing"):
        check_checkpoint(tmp_path)
    (tmp_path / RECORD_FILE).write_text("{}")
    check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": ')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        check_checkpoint(tmp_path)


def test_packed_w4a16_checkpoint_is_recorded_and_reloads(tmp_path):
    # Group size 32 so that stories260K's 64-input layers really are packed to 4 bits; the
    # record is taken before saving, because a packed module has no `weight` any more once
    # save_pretrained has compressed it.
    recipe = group_32_recipe(tmp_path, "whisper_2of4_w4a16")
    out = tmp_path / "ckpt"
    assert main([*FAST, "--recipe", str(recipe), "--output-dir", str(out)]) == 0
    config = check_checkpoint(out)
    assert config["quantization_config"]["format"] == "pack-quantized"
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["modifiers"] == ["WhisperModifier", "QuantizationModifier"]
    assert record["layers"]["model.layers.0.mlp.gate_proj"]["pattern"] == "2:4"
    model = load_checkpoint(out)  # unpacks
    gate = model.model.layers[0].mlp.gate_proj.weight
    assert ((gate == 0).reshape(gate.shape[0], -1, 4).sum(-1) >= 2).all()
