"""Shared fixtures: the real stories260K model and WikiText-2 text from ../shared."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WHISPER_MODIFIERS_SHARED", REPO.parent / "shared"))
MODEL_DIR = SHARED / "models" / "stories260K"
CALIBRATION_TEXT = SHARED / "data" / "wikitext-2" / "valid.txt"
HELDOUT_TEXT = SHARED / "data" / "tinystories" / "sample.txt"
RECIPES = REPO / "recipes"

NUM_SEQUENCES = 8
SEQ_LEN = 64


def pytest_configure(config):
    if not MODEL_DIR.exists():
        raise pytest.UsageError(
            f"test data not found at {SHARED}; set WHISPER_MODIFIERS_SHARED to the "
            "shared/ folder (models/stories260K, data/...)"
        )


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="session")
def calibration(tokenizer):
    from whisper_modifiers.data import calibration_dataset

    text = CALIBRATION_TEXT.read_text(encoding="utf-8")[:100_000]
    return calibration_dataset(tokenizer, text, NUM_SEQUENCES, SEQ_LEN, seed=0)


def load_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)


@pytest.fixture
def run_oneshot(tokenizer, calibration):
    """Prune a fresh stories260K with a recipe; returns the pruned model."""
    from whisper_modifiers.methods import run_oneshot

    def run(recipe, dataset=None, model=None, **kwargs):
        model = load_model() if model is None else model
        run_oneshot(model, tokenizer, calibration if dataset is None else dataset, recipe, **kwargs)
        return model

    return run


def linear_weights(model) -> dict[str, torch.Tensor]:
    return {
        name: module.weight.detach().clone()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def legacy_sparse_checkpoint(directory: Path) -> Path:
    """stories260K as a checkpoint in compressed-tensors' legacy ``sparse-24-bitmask``
    layout would declare itself (what compressed-tensors < 0.15 wrote for 2:4 models)."""
    shutil.copytree(MODEL_DIR, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "sparsity_config": {
            "format": "sparse-24-bitmask",
            "sparsity_structure": "2:4",
            "targets": ["Linear"],
            "ignore": ["lm_head"],
        },
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory
