"""Unstructured (and N:M other than 2:4) checkpoints stored compressed in the bitmask layout
(``format.bitmask``): whisper-prune's and oneshot's save, the checks before loading, and
transformers loading them back (stories260K; vLLM in tests/test_serving.py)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import (
    CALIBRATION_TEXT,
    HELDOUT_TEXT,
    MODEL_DIR,
    dense_state_dict,
    two_of_four_by_magnitude,
)
from whisper_modifiers.checkpoint import load_checkpoint
from whisper_modifiers.cli import main as whisper_prune
from whisper_sparse.cpu.linear import CpuBitmaskLinear, cpu_serving_refusal
from whisper_sparse.format.bits import (
    CorruptCheckpointError,
    pack_bits,
    unpack_bits,
)
from whisper_sparse.format.checkpoint import REPORT_FILE, check_checkpoint
from whisper_sparse.format.declaration import (
    BITMASK_FORMAT,
    LEGACY_QUANT_METHOD,
    QUANT_METHOD,
    STOCK_LOADER_GUARD,
    STOCK_LOADER_GUARDS,
)
from whisper_sparse.format.layout import write_compressed

pytestmark = pytest.mark.slow

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
DECODER_LINEARS = 7 * 5  # stories260K: 5 layers of q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """wanda_50 on stories260K, stored compressed (the default) and dense (the same
    pruning: same seed and data), and what whisper-prune printed for the first."""
    root = tmp_path_factory.mktemp("wanda_50")
    printed = {}
    for layout in ("auto", "dense"):
        out = root / layout
        argv = [*FAST, "--recipe", "wanda_50", "--layout", layout, "--output-dir", str(out)]
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            assert whisper_prune(argv) == 0
        printed[layout] = captured.getvalue()
    return root / "auto", root / "dense", printed["auto"]


def test_unstructured_recipes_store_the_bitmask_layout(pruned):
    compressed, dense, printed = pruned
    config = check_checkpoint(compressed)
    declared = config["quantization_config"]
    assert declared["quant_method"] == QUANT_METHOD
    assert declared["format"] == BITMASK_FORMAT and declared["sparsity_structure"] == "unstructured"
    assert declared["targets"] == [] and len(declared["bitmask_targets"]) == DECODER_LINEARS
    assert "lm_head" not in declared["bitmask_targets"]
    assert config["transformers_weights"] == STOCK_LOADER_GUARD
    tensors = load_file(compressed / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj"
    assert {f"{name}.{part}" for part in ("compressed", "bitmask", "row_offsets", "shape")} <= (
        tensors.keys()
    )
    assert f"{name}.weight" not in tensors and tensors[f"{name}.compressed"].dim() == 1
    report = json.loads((compressed / REPORT_FILE).read_text())
    assert report["layout"] == "compressed"
    sizes = report["compressed"]
    assert sizes["compressed_bytes"] <= 0.58 * sizes["dense_bytes"]  # float32, 50 %
    assert len(sizes["bitmask"]) == DECODER_LINEARS and not sizes["kept_dense"]
    whole = (compressed / "model.safetensors").stat().st_size
    dense_whole = (dense / "model.safetensors").stat().st_size
    assert whole < dense_whole
    ratio = sizes["checkpoint_bytes"] / sizes["dense_checkpoint_bytes"]
    assert f"{ratio:.2f}x the dense layout" in printed
    assert json.loads((dense / REPORT_FILE).read_text())["layout"] == "dense"
    assert not (check_checkpoint(dense).get("quantization_config") or {})


def test_a_compressed_save_reloads_bit_identical_to_the_dense_save(pruned, tmp_path):
    """load_checkpoint and plain transformers (which keeps the layers compressed where the
    CPU op runs), then save_pretrained of that model: the compressed layout again, and the
    dense save's weights bit for bit every time."""
    compressed, dense, _ = pruned
    reference = load_checkpoint(dense).state_dict()
    ours = load_checkpoint(compressed).state_dict()
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
    plain = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32)
    kept = sorted(n for n, m in plain.named_modules() if isinstance(m, CpuBitmaskLinear))
    declared = check_checkpoint(compressed)["quantization_config"]["bitmask_targets"]
    op_runs = cpu_serving_refusal("cpu", torch.float32) is None
    assert kept == (sorted(declared) if op_runs else [])
    state = dense_state_dict(plain)
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    ids = torch.tensor([[1, 50, 100, 200, 300, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            plain(ids).logits, load_checkpoint(dense)(ids).logits, rtol=1e-5, atol=1e-5
        )
    plain.save_pretrained(tmp_path / "resaved")
    if kept:
        resaved_config = json.loads((tmp_path / "resaved/config.json").read_text())
        assert resaved_config["quantization_config"]["quant_method"] == QUANT_METHOD
        assert resaved_config["transformers_weights"] == STOCK_LOADER_GUARD
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", dtype=torch.float32)
    resaved = dense_state_dict(again)
    assert all(torch.equal(resaved[k], reference[k]) for k in reference)


def test_dense_kernel_mode_decompresses_at_load_bit_identical(pruned, monkeypatch):
    """``WHISPER_MODIFIERS_SPARSE=dense`` (as on a GPU or a CPU without the op): every
    bitmask layer becomes an ordinary Linear whose weight is the dense save's, bit for bit."""
    compressed, dense, _ = pruned
    monkeypatch.setenv("WHISPER_MODIFIERS_SPARSE", "dense")
    plain = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32)
    assert not any(isinstance(m, CpuBitmaskLinear) for m in plain.modules())
    reference = load_checkpoint(dense).state_dict()
    state = plain.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference)


def test_stock_transformers_refuses_it_naming_the_package(pruned):
    stock = (
        "import sys; from transformers import AutoModelForCausalLM as M; "
        "assert 'whisper_modifiers' not in sys.modules; M.from_pretrained(sys.argv[1])"
    )
    done = subprocess.run(
        [sys.executable, "-c", stock, str(pruned[0])], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1
    assert "ValueError" in done.stderr and "whisper-sparse" in done.stderr


def corrupted(source, directory, change) -> str:
    """A copy of ``source`` whose weights ``change`` altered."""
    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_a_corrupt_layer_is_refused_naming_it_before_any_weight_loads(pruned, tmp_path):
    """A bit moved from one row to the next (its offsets then disagree), a truncated values
    tensor, a padding bit set, a layer declared unstructured but stored otherwise: every
    loader raises ``CorruptCheckpointError`` naming the layer."""
    layer = "model.layers.1.mlp.up_proj"

    def moved_bit(tensors):
        bits = unpack_bits(tensors[f"{layer}.bitmask"], 64)
        row = bits[3]
        kept, free = int(row.nonzero()[0]), int((~bits[4]).nonzero()[0])
        bits[3, kept], bits[4, free] = False, True
        tensors[f"{layer}.bitmask"] = pack_bits(bits)

    def truncated(tensors):
        tensors[f"{layer}.compressed"] = tensors[f"{layer}.compressed"][:-5].clone()

    def padding(tensors):
        name = "model.layers.1.mlp.down_proj"  # 172 inputs: four padding bits a row
        tensors[f"{name}.bitmask"][0, -1] |= 0x80

    def dense_instead(tensors):
        tensors[f"{layer}.weight"] = torch.zeros(172, 64)
        for part in ("compressed", "bitmask", "row_offsets", "shape"):
            del tensors[f"{layer}.{part}"]

    cases = [
        (moved_bit, rf"{layer}\.row_offsets\[4\]"),
        (truncated, rf"{layer}\.compressed holds \d+ values, but {layer}\.bitmask marks"),
        (padding, r"model\.layers\.1\.mlp\.down_proj\.bitmask marks inputs past 172"),
        (
            dense_instead,
            rf"{layer}: config.json declares it sparse-bitmask, but the "
            "checkpoint stores it dense",
        ),
    ]
    for index, (change, message) in enumerate(cases):
        bad = corrupted(pruned[0], tmp_path / f"bad{index}", change)
        with pytest.raises(CorruptCheckpointError, match=message):
            load_checkpoint(bad)
        with pytest.raises(CorruptCheckpointError, match=message):
            AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32)


def test_checkpoints_declared_before_unstructured_layers_and_legacy_ones_load(pruned, tmp_path):
    """A compressed-tensors < 0.15 ``sparse-bitmask`` checkpoint (the same tensors) loads
    as ours does; a 2:4 checkpoint written under the method's first name and guard too."""
    compressed, dense, _ = pruned
    reference = load_checkpoint(dense).state_dict()
    legacy = tmp_path / "legacy"
    shutil.copytree(compressed, legacy)
    config = json.loads((legacy / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "sparsity_config": {
            "format": "sparse-bitmask",
            "sparsity_structure": "unstructured",
            "targets": ["Linear"],
            "ignore": ["lm_head"],
        },
    }
    del config["transformers_weights"]
    (legacy / "config.json").write_text(json.dumps(config))
    ours = load_checkpoint(legacy).state_dict()
    assert all(torch.equal(ours[k], reference[k]) for k in reference)

    first = tmp_path / "first-name"  # 2:4, as the plugin's first version declared it
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    names = two_of_four_by_magnitude(model)
    model.save_pretrained(first)
    write_compressed(first, names)
    config = json.loads((first / "config.json").read_text())
    config["quantization_config"] = {
        key: config["quantization_config"][key]
        for key in ("format", "sparsity_structure", "targets")
    }
    config["quantization_config"]["quant_method"] = LEGACY_QUANT_METHOD
    config["transformers_weights"] = STOCK_LOADER_GUARDS[1]
    (first / "config.json").write_text(json.dumps(config))
    loaded = dense_state_dict(AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_a_layer_that_would_not_shrink_stays_dense(tmp_path):
    """``write_compressed`` stores an unstructured layer compressed only where that is
    smaller: a layer with almost no zeros keeps its dense weight and is not declared."""
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    sparse, full = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj"
    with torch.no_grad():
        weight = model.get_submodule(sparse).weight
        weight.mul_(torch.rand_like(weight) < 0.5)
        model.get_submodule(full).weight[:, ::16] = 0  # 1 in 16 zero: larger compressed
    model.save_pretrained(tmp_path)
    sizes = write_compressed(tmp_path, [], [sparse, full])
    assert sizes["bitmask"] == [sparse] and sizes["kept_dense"] == [full]
    declared = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert declared["bitmask_targets"] == [sparse]
    tensors = load_file(tmp_path / "model.safetensors")
    assert f"{full}.weight" in tensors and f"{sparse}.row_offsets" in tensors
