"""The ``whisper_layerwise`` calibration pipeline (``modifiers/layerwise_pipeline.py``) on
stories260K against llmcompressor's sequential pipeline: stock modifiers, a quantized LM
head after the last layer, chained recipes through whisper-prune, the fallback and bad
settings. Our methods, torchrun and SDPA are compared in ``test_distributed.py``."""

from __future__ import annotations

import json

import pytest
import torch
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
from llmcompressor.modifiers.quantization import GPTQModifier
from loguru import logger
from safetensors.torch import load_file

from conftest import CALIBRATION_TEXT, HELDOUT_TEXT, MODEL_DIR, load_model
from whisper_modifiers.cli import REPORT_FILE
from whisper_modifiers.cli import main as whisper_prune
from whisper_modifiers.modifiers import PIPELINE_NAME

HEAD = ["re:.*lm_head"]
STOCK = {
    "wanda": lambda: WandaPruningModifier(sparsity=0.5, mask_structure="2:4", ignore=HEAD),
    "sparsegpt": lambda: SparseGPTModifier(sparsity=0.5, ignore=HEAD),
    "gptq_w8a8": lambda: GPTQModifier(targets=["Linear"], scheme="W8A8", ignore=["lm_head"]),
    # no ignore: the LM head, after the last decoder layer, is quantized too
    "gptq_w8a8_with_lm_head": lambda: GPTQModifier(targets=["Linear"], scheme="W8A8"),
}


def stock_oneshot(tokenizer, calibration, modifier, **kwargs) -> dict[str, torch.Tensor]:
    """llmcompressor's ``oneshot`` with a stock modifier as it is (``methods.run_oneshot``
    would swap Wanda and SparseGPT for their order-independent twins); returns the state."""
    from llmcompressor import oneshot
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    model = load_model()
    loader = DataLoader(
        calibration.with_format("torch"), batch_size=1, collate_fn=default_data_collator
    )
    oneshot(model=model, tokenizer=tokenizer, dataset=loader, recipe=[modifier], **kwargs)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same_state(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name


@pytest.mark.parametrize("name", list(STOCK))
def test_stock_modifiers_give_the_sequential_pipelines_bits(
    monkeypatch, tokenizer, calibration, name
):
    """With eager attention, as llmcompressor's pipeline runs the layers (``auto``'s choice
    on a CPU; pinned, since on a GPU ``auto`` runs SDPA: an H100 moved bits of o_proj),
    Wanda, SparseGPT and GPTQ (weights, scales, zero points) are the same bits."""
    monkeypatch.setenv("WHISPER_LAYERWISE_ATTENTION", "eager")
    sequential = stock_oneshot(tokenizer, calibration, STOCK[name]())
    layerwise = stock_oneshot(tokenizer, calibration, STOCK[name](), pipeline=PIPELINE_NAME)
    assert_same_state(sequential, layerwise)
    if name == "gptq_w8a8_with_lm_head":  # calibrated on the last layer's outputs
        dense = load_model().lm_head.weight
        assert "lm_head.weight_scale" in layerwise
        # on a GPU the state stays where oneshot put the model (an H200 failed here on cuda:0)
        assert not torch.equal(layerwise["lm_head.weight"].cpu(), dense)


def test_a_model_whose_layers_are_no_chain_falls_back_in_one_line(tokenizer, calibration):
    """Split at the MLPs, the model's forward does not feed one MLP's output to the next:
    the pipeline says so in one line and runs llmcompressor's sequential pipeline."""
    messages = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        kwargs = {"sequential_targets": ["LlamaMLP"]}
        fallback = stock_oneshot(
            tokenizer, calibration, STOCK["wanda"](), pipeline=PIPELINE_NAME, **kwargs
        )
    finally:
        logger.remove(sink)
    notes = [m for m in messages if m.startswith(PIPELINE_NAME)]
    assert len(notes) == 1 and "not the previous layer's output" in notes[0], messages
    assert notes[0].strip().endswith("using llmcompressor's sequential pipeline")
    assert_same_state(stock_oneshot(tokenizer, calibration, STOCK["wanda"](), **kwargs), fallback)


def test_a_bad_attention_setting_is_refused_before_any_work(monkeypatch, tokenizer, calibration):
    from whisper_modifiers.methods import build_recipe, run_oneshot

    monkeypatch.setenv("WHISPER_LAYERWISE_ATTENTION", "flash")
    model = load_model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match="WHISPER_LAYERWISE_ATTENTION must be one of auto, eager, model; got 'flash'",
    ):
        run_oneshot(
            model, tokenizer, calibration, build_recipe("wisp", 0.5, "2:4"), pipeline=PIPELINE_NAME
        )
    assert_same_state(before, model.state_dict())


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


def test_whisper_prune_chained_recipe_is_the_same_under_both_pipelines(monkeypatch, tmp_path):
    """Whisper 2:4 then masked GPTQ W8A8: each modifier calibrates in turn under either
    pipeline (oneshot's ``independent`` order), so the checkpoints hold the same bits
    (eager attention, as in the test above)."""
    monkeypatch.setenv("WHISPER_LAYERWISE_ATTENTION", "eager")
    states = {}
    for pipeline in ("sequential", PIPELINE_NAME):
        out = tmp_path / pipeline
        argv = [
            *FAST,
            "--recipe",
            "whisper_2of4_w8a8",
            "--layout",
            "dense",
            "--pipeline",
            pipeline,
            "--output-dir",
            str(out),
        ]
        assert whisper_prune(argv) == 0
        report = json.loads((out / REPORT_FILE).read_text())
        assert report["calibration"]["pipeline"] == pipeline
        states[pipeline] = load_file(out / "model.safetensors")
    assert any(name.endswith("weight_scale") for name in states["sequential"])
    assert_same_state(states["sequential"], states[PIPELINE_NAME])


def test_whisper_prune_pipeline_choice(tmp_path, monkeypatch, capsys):
    from whisper_modifiers.methods import calibration_pipeline

    # auto: ours on a GPU (faster there, wherever the activation cache is), else sequential
    expected = PIPELINE_NAME if torch.cuda.is_available() else "sequential"
    assert calibration_pipeline("auto") == expected
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "is_available", lambda: True)
        assert calibration_pipeline("auto") == PIPELINE_NAME
    argv = [*FAST, "--recipe", "wisp_2of4", "--output-dir", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exited:  # argparse
        whisper_prune([*argv, "--pipeline", "basic"])
    assert exited.value.code == 2
    assert "--pipeline: invalid choice: 'basic'" in capsys.readouterr().err
    monkeypatch.setenv("WHISPER_LAYERWISE_ATTENTION", "fast")
    assert whisper_prune([*argv, "--pipeline", PIPELINE_NAME]) == 2
    assert "WHISPER_LAYERWISE_ATTENTION must be one of auto, eager, model; got 'fast'" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["wanda", "sparsegpt"])
def test_on_a_gpu_sdpa_keeps_the_masks(tokenizer, calibration, name):
    """On CUDA the layers run the model's SDPA attention: masks >= 99.9 % equal."""
    sequential = stock_oneshot(tokenizer, calibration, STOCK[name]())
    layerwise = stock_oneshot(tokenizer, calibration, STOCK[name](), pipeline=PIPELINE_NAME)
    weights = [n for n in sequential if n.endswith("proj.weight")]
    same = sum(((sequential[n] != 0) == (layerwise[n] != 0)).sum().item() for n in weights)
    assert same / sum(sequential[n].numel() for n in weights) >= 0.999
