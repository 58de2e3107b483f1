"""whisper-prune end to end on stories260K, and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import CALIBRATION_TEXT, HELDOUT_TEXT, MODEL_DIR
from whisper_modifiers.cli import REPORT_FILE, main

FAST = [
    "--model", str(MODEL_DIR),
    "--calibration", str(CALIBRATION_TEXT),
    "--num-sequences", "4", "--seq-len", "64",
    "--eval-text", str(HELDOUT_TEXT), "--eval-seq-len", "128", "--eval-windows", "4",
]  # fmt: skip


def test_prunes_reports_and_saves(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main([*FAST, "--recipe", "wisp_plus_2of4", "--output-dir", str(out)]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    assert math.isfinite(report["dense_perplexity"]) and math.isfinite(report["pruned_perplexity"])
    assert report["pruned_perplexity"] > report["dense_perplexity"]
    assert report["sparsity"] == pytest.approx(0.5)
    assert report["pruning_seconds"] > 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gate = model.model.layers[0].mlp.gate_proj.weight
    assert ((gate == 0).reshape(gate.shape[0], -1, 4).sum(-1) == 2).all()
    printed = capsys.readouterr().out
    assert "| stories260K | wisp_plus_2of4 |" in printed
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_missing_model(tmp_path, capsys):
    assert (
        main([*FAST[2:], "--model", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")])
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "neither a file nor one of"),
        ("a: [unclosed", "cannot be used"),
        ("s_stage:\n  s_modifiers:\n    NoSuchModifier:\n      sparsity: 0.5\n", "cannot be used"),
        ("s_stage:\n  s_modifiers:\n    WispModifier:\n      sparsity: 1.5\n", "sparsity"),
    ],
)
def test_unusable_recipe(tmp_path, capsys, content, message):
    recipe = tmp_path / "recipe.yaml"
    if content is not None:
        recipe.write_text(content)
    assert main([*FAST, "--recipe", str(recipe), "--output-dir", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_existing_checkpoint_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / REPORT_FILE).write_text("{}")  # written by whisper-prune
    assert main([*FAST, "--recipe", "wanda_2of4", "--output-dir", str(out)]) == 2
    assert "already holds a whisper-prune checkpoint" in capsys.readouterr().err
    assert (out / "config.json").read_text() == "{}"
