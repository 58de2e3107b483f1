"""The whole path on a model that runs anywhere in seconds: stories260K from ../shared,
Whisper 2:4 and its SparseGPT baseline, perplexity before and after, a saved checkpoint.

    python examples/stories260k.py [path/to/shared]
"""

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from whisper_modifiers.data import calibration_dataset
from whisper_modifiers.evaluation import perplexity
from whisper_modifiers.methods import build_recipe, run_oneshot

shared = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[2] / "shared")
model_dir = shared / "models" / "stories260K"
tokenizer = AutoTokenizer.from_pretrained(model_dir)
calibration = calibration_dataset(
    tokenizer, (shared / "data/wikitext-2/valid.txt").read_text(), 64, 256, seed=0
)
heldout = tokenizer((shared / "data/tinystories/sample.txt").read_text())["input_ids"]

dense = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
print(f"dense       perplexity {perplexity(dense, heldout, 256):.2f}")
for method in ("sparsegpt", "whisper"):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    output = Path(tempfile.mkdtemp()) / f"stories260K-{method}-2of4"
    recipe = build_recipe(method, 0.5, "2:4", seed=0)
    run_oneshot(model, tokenizer, calibration, recipe, output_dir=str(output))
    print(f"{method:<11} perplexity {perplexity(model, heldout, 256):.2f}  saved to {output}")
