"""Fingerprints of what every recipe in ``recipes/`` does to a model, to prove a refactor of
the modifiers changes nothing: the SHA-256 of every tensor of the pruned model's state dict
(weights, so masks too, and a quantized chain's scales), and ``gamma: auto``'s record
(choices, held-out errors, model check).

    python benchmarks/golden_masks.py record benchmarks/results/golden_masks/golden_masks-avx2.json
    python benchmarks/golden_masks.py check benchmarks/results/golden_masks/golden_masks-avx2.json

Models: stories260K (``../shared``), and a tiny random Phi-3 (fused gate_up) and Qwen3-MoE
(routed experts) built from transformers configs with seed 0; calibration: 8 sequences of
64 tokens of WikiText-2 (the tests' set). W4A16 recipes run with groups of 32 (the tests'
variant: these models have 64 inputs). A recipe a model refuses records the error.
``VARIANTS`` adds, on stories260K, the settings no recipe file uses (pairings, mixtures,
folds, batch size 2, the layerwise pipeline, the stock baselines). The
floating-point sums depend on the CPU's kernels, so ``check`` compares only on the CPU
line the file was recorded on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import (  # noqa: E402
    CALIBRATION_TEXT,
    MODEL_DIR,
    NUM_SEQUENCES,
    SEQ_LEN,
    group_32_recipe,
    tiny_model,
)

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def models(directory: Path, tokenizer) -> dict[str, Path]:
    from transformers import Phi3Config, Phi3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    built = {"stories260K": MODEL_DIR}
    for name, model_class, config in [
        ("phi3", Phi3ForCausalLM, Phi3Config(intermediate_size=128, pad_token_id=0, **TINY)),
        (
            "qwen3_moe",
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                intermediate_size=128,
                moe_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=2,
                head_dim=32,
                **TINY,
            ),
        ),
    ]:
        built[name] = tiny_model(directory / name, tokenizer, model_class, config)
    return built


# settings no recipe file uses, on stories260K: (method, fields, run_oneshot's options)
VARIANTS = [
    ("wisp", {"pairing": "centered"}, {}),
    ("wisp", {"pairing": "nearest"}, {}),
    ("wisp", {"num_permutations": 2, "gamma": 0.3}, {}),
    ("wisp", {"comparison_group": "layer", "sparsity": 0.5}, {}),
    ("wisp", {"gamma": "auto", "gamma_folds": 4, "gamma_evidence": 0.0}, {}),
    ("wisp_plus", {"gamma": 0.3}, {}),
    ("wisp_plus", {"specialized_fraction": 0.5, "pairing": "nearest"}, {}),
    ("wisp_plus", {}, {"batch_size": 2}),
    ("whisper", {"pairing": "centered"}, {}),
    ("whisper", {"pairing": "nearest", "num_permutations": 1}, {}),
    ("whisper", {"gamma": "auto", "gamma_folds": 4, "gamma_model_check": False}, {}),
    ("whisper", {"gamma": "auto", "gamma_evidence": 0.0, "gamma_criterion": "absolute"}, {}),
    ("whisper", {}, {"batch_size": 2}),
    ("whisper", {}, {"pipeline": "whisper_layerwise"}),
    ("ria_wisp_plus", {"gamma": 0.1}, {}),
    ("alps_whisper", {"gamma": "auto", "gamma_candidates": [0.01, 1.0]}, {}),
    ("wanda", {}, {}),
    ("sparsegpt", {}, {}),
]


def fingerprint(model, recipe, calibration, tokenizer, **options) -> dict:
    """The state dict's tensors and ``gamma: auto``'s record (choices, held-out errors,
    model check) after ``recipe``."""
    from llmcompressor.core import active_session

    from whisper_modifiers.methods import run_oneshot

    run_oneshot(model, tokenizer, calibration, recipe, **options)
    tensors = {
        name: hashlib.sha256(
            tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()[:24]
        for name, tensor in sorted(model.state_dict().items())
    }
    gamma = {}
    for modifier in active_session().lifecycle.recipe.modifiers:
        if hasattr(modifier, "gamma_selection"):
            gamma.update(modifier.gamma_selection())  # choices, errors, model check
    return {"tensors": tensors, "gamma": gamma}


def record_all() -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import whisper_modifiers  # noqa: F401
    from whisper_modifiers.data import calibration_dataset
    from whisper_sparse.cpu.cpu_info import cpu_model

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")[:100_000]
    calibration = calibration_dataset(tokenizer, text, NUM_SEQUENCES, SEQ_LEN, seed=0)
    results = {
        "cpu": f"{cpu_model()} {torch.backends.cpu.get_cpu_capability()}",
        "torch": torch.__version__,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model_name, source in models(tmp, tokenizer).items():
            for recipe in sorted((REPO / "recipes").glob("*.yaml")):
                path = recipe
                if "w4a16" in recipe.stem:
                    path = group_32_recipe(tmp, recipe.stem)
                model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
                key = f"{model_name}/{recipe.stem}"
                try:
                    results["runs"][key] = fingerprint(model, str(path), calibration, tokenizer)
                except (ValueError, RuntimeError) as error:
                    results["runs"][key] = {"error": f"{type(error).__name__}: {error}"[:300]}
                print(key, "error" if "error" in results["runs"][key] else "ok", flush=True)
        for method, fields, options in VARIANTS:
            from whisper_modifiers.methods import build_recipe

            fields = {
                "sparsity": 0.5,
                "mask_structure": "0:0" if "sparsity" in fields else "2:4",
                **fields,
            }
            key = f"stories260K/{method}:" + ";".join(
                f"{k}={v}" for k, v in sorted({**fields, **options}.items())
            )
            model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
            recipe = build_recipe(
                method, fields.pop("sparsity"), fields.pop("mask_structure"), **fields
            )
            results["runs"][key] = fingerprint(model, recipe, calibration, tokenizer, **options)
            print(key, "ok", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["record", "check"])
    parser.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    results = record_all()
    if args.action == "record":
        args.file.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        return 0
    expected = json.loads(args.file.read_text())
    if expected["cpu"] != results["cpu"] or expected["torch"] != results["torch"]:
        print(
            f"recorded on {expected['cpu']} (torch {expected['torch']}); this is "
            f"{results['cpu']} (torch {results['torch']}): not comparable"
        )
        return 2
    differ = [key for key in expected["runs"] if expected["runs"][key] != results["runs"].get(key)]
    for key in differ:
        print("DIFFERS", key)
    print(f"{len(expected['runs']) - len(differ)} of {len(expected['runs'])} runs bit-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
