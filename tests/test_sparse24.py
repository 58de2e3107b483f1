"""The compressed 2:4 checkpoint format: tensors, whisper-prune's writer, loading back
(stories260K; SmolLM2 and vLLM in tests/test_serving.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import CALIBRATION_TEXT, HELDOUT_TEXT, MODEL_DIR, dense_state_dict, group_32_recipe
from whisper_modifiers.checkpoint import load_checkpoint
from whisper_modifiers.cli import main as whisper_prune
from whisper_sparse import (
    QUANT_METHOD,
    CorruptCheckpointError,
    NotTwoFourError,
    check_two_four,
    compress_24,
    decompress_24,
)
from whisper_sparse.cpu.linear import CpuSparse24Linear, cpu_serving_refusal
from whisper_sparse.driver.cli import main as whisper_serve
from whisper_sparse.format.bits import pack_bits, unpack_bits
from whisper_sparse.format.checkpoint import REPORT_FILE, check_checkpoint
from whisper_sparse.format.declaration import STOCK_LOADER_GUARD

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


def random_two_four(rows=8, columns=32, seed=0) -> torch.Tensor:
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))
    groups = weight.reshape(rows, -1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.abs().topk(2, dim=-1).indices, True)
    return (groups * keep).reshape(rows, columns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact_and_the_layout_is_the_legacy_one(dtype):
    weight = random_two_four().to(dtype)
    weight[0, :4] = 0  # a group with fewer than two nonzeros
    weight[1, 4:8] = torch.tensor([0, 3, 0, 0], dtype=dtype)
    compressed, bitmask = compress_24(weight)
    assert compressed.shape == (8, 16) and compressed.dtype == dtype
    assert bitmask.shape == (8, 4) and bitmask.dtype == torch.uint8
    assert torch.equal(decompress_24(compressed, bitmask, weight.shape), weight)
    mask = unpack_bits(bitmask, 32)
    assert (mask.reshape(8, -1, 4).sum(-1) == 2).all()  # exactly two marks per group
    assert torch.equal(mask[1, 4:8], torch.tensor([True, True, False, False]))  # padded
    # compressed-tensors < 0.15 packed with numpy.packbits(..., bitorder="little")
    assert numpy.array_equal(
        pack_bits(mask).numpy(), numpy.packbits(mask.numpy(), axis=-1, bitorder="little")
    )
    assert torch.equal(compressed, weight[mask].reshape(8, 16))  # row-major kept values


def test_bytes_are_at_most_0_53_of_dense():
    weight = random_two_four(64, 256)
    compressed, bitmask = compress_24(weight)
    ratio = (compressed.numel() * 4 + bitmask.numel()) / (weight.numel() * 4)
    assert ratio == pytest.approx(0.5 + 1 / 32)


def test_not_two_four_is_refused_with_the_name():
    weight = random_two_four()
    weight[3, 9] = 1.0
    with pytest.raises(NotTwoFourError, match=r"layer\.x is not exactly 2:4: 1 of 64.*row 3"):
        check_two_four(weight, "layer.x")
    with pytest.raises(NotTwoFourError, match="layer.y: shape"):
        compress_24(torch.zeros(4, 6), "layer.y")


def test_whisper_prune_writes_the_compressed_layout_and_it_reloads_bit_identically(
    tmp_path, monkeypatch
):
    compressed, dense = tmp_path / "compressed", tmp_path / "dense"
    assert whisper_prune([*FAST, "--recipe", "whisper_2of4", "--output-dir", str(compressed)]) == 0
    args = [*FAST, "--recipe", "whisper_2of4", "--layout", "dense", "--output-dir", str(dense)]
    assert whisper_prune(args) == 0
    config = check_checkpoint(compressed)
    assert config["quantization_config"]["quant_method"] == QUANT_METHOD
    assert "model.layers.0.mlp.gate_proj" in config["quantization_config"]["targets"]
    assert "lm_head" not in config["quantization_config"]["targets"]
    report = json.loads((compressed / REPORT_FILE).read_text())
    assert report["layout"] == "compressed"
    sizes = report["compressed"]
    assert sizes["compressed_bytes"] <= 0.56 * sizes["dense_bytes"]
    whole = (compressed / "model.safetensors").stat().st_size
    dense_whole = (dense / "model.safetensors").stat().st_size
    print(
        f"\nstories260K Whisper 2:4: 2:4 Linear weights {sizes['compressed_bytes']} B "
        f"compressed vs {sizes['dense_bytes']} B dense; checkpoint {whole} vs "
        f"{dense_whole} B ({whole / dense_whole:.3f}x)"
    )
    ours, reference = load_checkpoint(compressed).state_dict(), load_checkpoint(dense).state_dict()
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in reference)

    # plain transformers, after `import whisper_modifiers` (its quantizer registration), on
    # a CPU where the sparse CPU op runs: every 2:4 Linear stays compressed (the checkpoint's
    # own tensors) and runs the op; save_pretrained writes the compressed layout again,
    # guard included, and it reloads the same
    plain = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32)
    kept = sorted(n for n, m in plain.named_modules() if isinstance(m, CpuSparse24Linear))
    op_runs = cpu_serving_refusal("cpu", torch.float32) is None
    assert kept == (sorted(config["quantization_config"]["targets"]) if op_runs else [])
    assert dense_state_dict(plain).keys() == reference.keys()
    assert all(torch.equal(dense_state_dict(plain)[k], reference[k]) for k in reference)
    plain.save_pretrained(tmp_path / "resaved")
    resaved_config = json.loads((tmp_path / "resaved/config.json").read_text())
    if kept:
        assert resaved_config["quantization_config"]["quant_method"] == QUANT_METHOD
        assert resaved_config["transformers_weights"] == STOCK_LOADER_GUARD
    resaved = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", dtype=torch.float32)
    assert all(torch.equal(dense_state_dict(resaved)[k], reference[k]) for k in reference)
    # the dense kernel mode: dense weights, no quantization left, and save_pretrained writes
    # the dense layout
    monkeypatch.setenv("WHISPER_MODIFIERS_SPARSE", "dense")
    plain = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32)
    assert getattr(plain.config, "quantization_config", None) is None
    assert all(torch.equal(plain.state_dict()[k], reference[k]) for k in reference)
    plain.save_pretrained(tmp_path / "dense-resaved")
    dense_config = json.loads((tmp_path / "dense-resaved/config.json").read_text())
    assert "transformers_weights" not in dense_config
    monkeypatch.delenv("WHISPER_MODIFIERS_SPARSE")
    resaved = AutoModelForCausalLM.from_pretrained(tmp_path / "dense-resaved", dtype=torch.float32)
    assert all(torch.equal(resaved.state_dict()[k], reference[k]) for k in reference)

    # stock transformers, without whisper_modifiers: refused before any weight loads,
    # naming the package (it used to random-initialise every 2:4 Linear and return)
    stock = (
        "import sys; from transformers import AutoModelForCausalLM as M; "
        "assert 'whisper_modifiers' not in sys.modules; M.from_pretrained(sys.argv[1])"
    )
    done = subprocess.run(
        [sys.executable, "-c", stock, str(compressed)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1
    assert "ValueError" in done.stderr and "whisper-sparse" in done.stderr


def test_a_layer_that_is_not_two_four_is_refused_at_save_time(tmp_path, capsys, monkeypatch):
    import whisper_modifiers.methods as methods

    real = methods.run_oneshot

    def run_oneshot(model, *args, **kwargs):  # pruning that leaves one layer not 2:4
        result = real(model, *args, **kwargs)
        with torch.no_grad():
            model.model.layers[3].mlp.up_proj.weight[5, :4] = 1.0
        return result

    monkeypatch.setattr(methods, "run_oneshot", run_oneshot)
    out = tmp_path / "ckpt"
    assert whisper_prune([*FAST, "--recipe", "wisp_2of4", "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert "model.layers.3.mlp.up_proj is not exactly 2:4" in err
    assert not out.exists() and not list(tmp_path.iterdir())


QUANTIZATION_ONLY = """\
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: ["Linear"]
      scheme: W8A8
      ignore: ["lm_head"]
"""


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ("whisper_2of4_w4a16", "packs weights to fewer bits"),
        ("quantization only", "recipe has no pruning modifier"),
    ],
)
def test_compressed_layout_needs_a_pruning_recipe_of_8_bit_values(
    tmp_path, capsys, recipe, message
):
    if recipe.endswith("w4a16"):  # groups of 128 would quantize no stories260K layer
        recipe = str(group_32_recipe(tmp_path, recipe))
    else:
        (tmp_path / "w8a8.yaml").write_text(QUANTIZATION_ONLY)
        recipe = str(tmp_path / "w8a8.yaml")
    out = str(tmp_path / "o")
    args = [*FAST, "--recipe", recipe, "--layout", "compressed", "--output-dir", out]
    assert whisper_prune(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["whisper_2of4_w8a8", "whisper_2of4_fp8"])
def test_quantized_chains_compress_their_8_bit_values(tmp_path, recipe):
    compressed, dense = tmp_path / "compressed", tmp_path / "dense"
    assert whisper_prune([*FAST, "--recipe", recipe, "--output-dir", str(compressed)]) == 0
    args = [*FAST, "--recipe", recipe, "--layout", "dense", "--output-dir", str(dense)]
    assert whisper_prune(args) == 0
    sizes = json.loads((compressed / REPORT_FILE).read_text())["compressed"]
    assert sizes["compressed_bytes"] <= 0.63 * sizes["dense_bytes"]  # 1/2 + 1/8 of 8 bits
    assert (compressed / "model.safetensors").stat().st_size < (
        dense / "model.safetensors"
    ).stat().st_size
    # dequantized weights: ours (decompress, times the scale) equal compressed-tensors'
    reference = load_checkpoint(dense).state_dict()
    plain = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32)
    for model in (load_checkpoint(compressed), plain):
        ours = model.state_dict()
        assert all(torch.equal(ours[k], reference[k]) for k in ours)


def test_4_bit_recipes_keep_the_dense_layout(tmp_path):
    recipe = str(group_32_recipe(tmp_path, "whisper_2of4_w4a16"))  # groups of 128: no layer
    out = tmp_path / "ckpt"
    assert whisper_prune([*FAST, "--recipe", recipe, "--output-dir", str(out)]) == 0
    assert json.loads((out / REPORT_FILE).read_text())["layout"] == "dense"
    quantization = check_checkpoint(out).get("quantization_config") or {}
    assert quantization.get("quant_method") != QUANT_METHOD


def test_decompress_refuses_a_bitmask_that_is_not_two_four_or_shapes_that_disagree():
    weight = random_two_four(4, 16)
    compressed, bitmask = compress_24(weight, "w")
    moved = unpack_bits(bitmask, 16).clone()
    row = moved[0]  # one mark moved from group 0 to group 1: the row's count is unchanged
    first_kept, first_free = int(row[:4].nonzero()[0]), int((~row[4:8]).nonzero()[0]) + 4
    row[first_kept], row[first_free] = False, True
    with pytest.raises(CorruptCheckpointError, match=r"layer\.bitmask is not 2:4: 2 of 16 "):
        decompress_24(compressed, pack_bits(moved), (4, 16), "layer")
    with pytest.raises(CorruptCheckpointError, match=r"layer\.compressed has shape \(4, 7\)"):
        decompress_24(compressed[:, :7], bitmask, (4, 16), "layer")  # truncated
    with pytest.raises(CorruptCheckpointError, match=r"layer\.bitmask has shape"):
        decompress_24(compressed, bitmask, (4, 24), "layer")  # a wrong .shape
    padded = pack_bits(torch.cat([unpack_bits(bitmask, 16), torch.ones(4, 8, dtype=bool)], 1))
    with pytest.raises(CorruptCheckpointError, match="marks inputs past 12"):
        decompress_24(compressed[:, :6], padded[:, :2], (4, 12), "layer")


def test_a_corrupt_checkpoint_fails_loudly_in_every_loader(tmp_path, capsys):
    """One bit of one layer's bitmask moved between two groups (the same count per row):
    transformers and load_checkpoint raise, naming the layer, before returning a model."""
    from safetensors.torch import load_file, save_file

    good = tmp_path / "good"
    assert whisper_prune([*FAST, "--recipe", "whisper_2of4", "--output-dir", str(good)]) == 0
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.bitmask"
    bits = unpack_bits(tensors[key], 64)
    row = bits[3]
    first_kept, first_free = int(row[:4].nonzero()[0]), int((~row[4:8]).nonzero()[0]) + 4
    row[first_kept], row[first_free] = False, True
    tensors[key] = pack_bits(bits)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    message = r"model\.layers\.1\.mlp\.up_proj\.bitmask is not 2:4.*row 3"
    with pytest.raises(CorruptCheckpointError, match=message):
        load_checkpoint(bad)
    with pytest.raises(CorruptCheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32)
    assert whisper_serve([str(bad), "--dry-run"]) == 2  # before vLLM starts
    assert "up_proj.bitmask is not 2:4" in capsys.readouterr().err
    # a .shape that disagrees with the config, and a file cut halfway
    tensors = load_file(good / "model.safetensors")
    tensors["model.layers.0.mlp.gate_proj.shape"] = torch.tensor([[64], [172]])  # swapped
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match=r"gate_proj\.(shape|bitmask)"):
        AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32)
    data = (good / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert whisper_serve([str(bad), "--dry-run"]) == 2
    assert f"{bad / 'model.safetensors'} cannot be read" in capsys.readouterr().err


def test_our_checkpoints_as_model(tmp_path, capsys):
    """A compressed 2:4 checkpoint prunes again (through its dense layout); a quantized
    one is refused before any weight loads, saying why."""
    first = tmp_path / "first"
    assert whisper_prune([*FAST, "--recipe", "whisper_2of4", "--output-dir", str(first)]) == 0
    again = [a if a != str(MODEL_DIR) else str(first) for a in FAST]
    assert (
        whisper_prune([*again, "--recipe", "wanda_2of4", "--output-dir", str(tmp_path / "again")])
        == 0
    )
    assert check_checkpoint(tmp_path / "again")["quantization_config"]["quant_method"] == (
        QUANT_METHOD
    )
    quantized = tmp_path / "w8a8"
    assert (
        whisper_prune([*FAST, "--recipe", "whisper_2of4_w8a8", "--output-dir", str(quantized)]) == 0
    )
    capsys.readouterr()
    again = [a if a != str(MODEL_DIR) else str(quantized) for a in FAST]
    assert (
        whisper_prune([*again, "--recipe", "wanda_2of4", "--output-dir", str(tmp_path / "refused")])
        == 2
    )
    assert f"--model {quantized} holds quantized weights" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
