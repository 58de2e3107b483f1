"""whisper-prune end to end on stories260K, and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import CALIBRATION_TEXT, HELDOUT_TEXT, MODEL_DIR, dense_state_dict
from whisper_modifiers.cli import REPORT_FILE, main

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
    "4",
]


def test_prunes_reports_and_saves(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main([*FAST, "--recipe", "wisp_plus_2of4", "--output-dir", str(out)]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    assert math.isfinite(report["dense_perplexity"]) and math.isfinite(report["pruned_perplexity"])
    assert report["pruned_perplexity"] > report["dense_perplexity"]
    assert report["sparsity"] == pytest.approx(0.5)
    assert report["pruning_seconds"] > 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gate = dense_state_dict(model)["model.layers.0.mlp.gate_proj.weight"]
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
        (
            "s_stage:\n  s_modifiers:\n    QuantizationModifier:\n      scheme: W8A8\n"
            "      targets: [Linear]\n      ignore: [lm_head]\n"
            "    WispModifier:\n      sparsity: 0.5\n",
            "QuantizationModifier comes before WispModifier; prune first, then quantize",
        ),
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


def refuse_non_finite(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_record_and_report_are_strict_json_and_count_the_windows_evaluated(tmp_path):
    """gamma: auto on 4 sequences holds out one, so a standard error over it is infinite:
    written as null. --eval-windows beyond the text's windows reports those evaluated."""
    from whisper_modifiers.evaluation import evaluation_text, evaluation_windows
    from whisper_sparse.format.checkpoint import RECORD_FILE

    out = tmp_path / "ckpt"
    argv = [*FAST, "--recipe", "wisp_auto_2of4", "--output-dir", str(out)]
    argv[argv.index("--eval-windows") + 1] = "1000"
    assert main(argv) == 0
    record = json.loads((out / RECORD_FILE).read_text(), parse_constant=refuse_non_finite)
    errors = [choice["difference_se"] for choice in record["gamma_selection"].values()]
    assert any(se is None for choices in errors for se in choices.values())
    report = json.loads((out / REPORT_FILE).read_text(), parse_constant=refuse_non_finite)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    ids = tokenizer(evaluation_text(str(HELDOUT_TEXT)), add_special_tokens=False)["input_ids"]
    assert report["evaluation"]["windows"] == len(evaluation_windows(ids, 128)) < 1000


def test_strict_json_writes_non_finite_numbers_as_null():
    from whisper_modifiers.checkpoint import strict_json

    text = strict_json({"a": float("inf"), "b": [1.5, float("nan")], "c": {"d": -float("inf")}})
    assert json.loads(text, parse_constant=refuse_non_finite) == {
        "a": None,
        "b": [1.5, None],
        "c": {"d": None},
    }


def test_same_calibration_and_evaluation_file_is_warned_about(tmp_path):
    from loguru import logger

    messages = []
    sink = logger.add(messages.append, level="WARNING")
    try:
        argv = [
            *FAST,
            "--recipe",
            "wanda_2of4",
            "--output-dir",
            str(tmp_path / "o"),
            "--skip-dense-eval",
        ]
        argv[argv.index("--eval-text") + 1] = str(CALIBRATION_TEXT)
        assert main(argv) == 0
    finally:
        logger.remove(sink)
    assert any("--calibration and --eval-text are the same file" in m for m in messages)
