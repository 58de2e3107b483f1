"""Diagnostics: Wasserstein distance, the gamma sweep, and whisper-diagnose end to end."""

from __future__ import annotations

import json

import torch

from conftest import CALIBRATION_TEXT, MODEL_DIR
from whisper_modifiers.diagnose_cli import main
from whisper_modifiers.diagnostics import (
    gamma_sweep,
    prune_layer,
    wasserstein_neurons,
    wasserstein_to_normal,
)


def test_wasserstein_distance_separates_gaussian_from_bimodal():
    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(1, 20000, generator=g) * 3 + 1
    bimodal = torch.cat([torch.randn(10000, generator=g) - 4, torch.randn(10000, generator=g) + 4])
    distances = wasserstein_to_normal(torch.cat([gaussian, bimodal.unsqueeze(0)]))
    assert distances[0] < 0.03  # standardisation removes scale and shift
    assert distances[1] > 0.2
    assert wasserstein_neurons(distances, 0.01).tolist() == [1]


def test_gamma_sweep_ends_at_sparsegpt_and_trades_wx_for_wdx():
    g = torch.Generator().manual_seed(1)
    mixing = torch.randn(32, 32, generator=g) / 32**0.5
    inputs = [torch.randn(64, 32, generator=g) @ mixing + 1.5 for _ in range(4)]
    pairs = [x - x[torch.randperm(64, generator=g)] for x in inputs]
    weight = torch.randn(48, 32, generator=g)
    rows = gamma_sweep(weight, inputs, pairs, [0.0, 0.01, 1.0])
    sparsegpt = prune_layer("sparsegpt", weight, inputs, pairs, 0.5, 2, 4)
    assert torch.equal(
        prune_layer("whisper", weight, inputs, pairs, 0.5, 2, 4, gamma=1.0), sparsegpt
    )
    assert rows[0]["mse_differences"] < rows[-1]["mse_differences"]
    assert rows[0]["mse_outputs"] > rows[-1]["mse_outputs"]
    assert rows[-1]["r2_means"] > rows[0]["r2_means"]


def test_whisper_diagnose_writes_its_files(tmp_path, capsys):
    out = tmp_path / "diag"
    argv = [
        "--model",
        str(MODEL_DIR),
        "--calibration",
        str(CALIBRATION_TEXT),
        "--num-sequences",
        "4",
        "--seq-len",
        "64",
        "--sparsities",
        "0.5",
        "0.7",
        "--gammas",
        "0.01",
        "1.0",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads((out / "diagnostics.json").read_text())
    assert report["module"] == "model.layers.2.mlp.gate_proj"
    assert len(report["mapping_difficulty"]) == 172
    assert set(report["difficulty_preserved"]) >= {"wanda", "wisp", "wisp_plus", "whisper"}
    for png in (
        "saliency_scatter",
        "saliency_distributions",
        "difficulty_vs_sparsity",
        "gamma_sweep",
    ):
        assert (out / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    assert "Wasserstein neurons" in capsys.readouterr().out
    # the output-directory rules of whisper-prune: an earlier report is never replaced
    # silently, and a directory it did not write never at all
    (out / "diagnostics.json").write_text('{"mine": 1}')
    assert main(argv) == 2
    assert "already holds diagnostics.json of an earlier whisper-diagnose" in (
        capsys.readouterr().err
    )
    assert json.loads((out / "diagnostics.json").read_text()) == {"mine": 1}
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads((out / "diagnostics.json").read_text())["module"] == report["module"]
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    argv[argv.index("--out") + 1] = str(foreign)
    assert main([*argv, "--overwrite"]) == 2
    assert "was not written by whisper-diagnose" in capsys.readouterr().err
    assert (foreign / "todo.txt").read_text() == "keep me"
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
