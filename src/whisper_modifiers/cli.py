"""``whisper-prune``: prune a model with a recipe, report perplexity and time, save it.

    whisper-prune                                    # Whisper 2:4 on the embedded default
    whisper-prune --model meta-llama/Llama-2-7b-hf --recipe wisp_plus_50 \\
        --calibration wikitext2 --eval-text wikitext2 --num-sequences 128 --seq-len 4096
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "whisper_2of4"
REPORT_FILE = "whisper_prune_report.json"


class UsageError(Exception):
    """Bad command-line input, reported before any work is done."""


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(recipe: str) -> Path:
    """A recipe file path, or the name of one in ``recipes/`` (e.g. ``wisp_2of4``)."""
    path = Path(recipe).expanduser()
    if not path.is_file():
        path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise UsageError(
            f"recipe {recipe!r} is neither a file nor one of: {', '.join(available_recipes())}"
        )
    from llmcompressor.recipe import Recipe

    import whisper_modifiers  # noqa: F401  (registers our modifiers by name)

    try:
        Recipe.create_instance(str(path))
    except Exception as error:  # a YAML or modifier error, shown as the user's problem
        raise UsageError(f"recipe {path} cannot be used: {error}") from error
    return path


def load_recipe(path: Path, model) -> list:
    """The recipe's modifiers; a group-wise quantization scheme (W4A16) leaves the layers
    it cannot quantize in 16-bit, with a warning, rather than failing mid-run."""
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.recipe import Recipe

    from whisper_modifiers.quantization import keep_indivisible_unquantized

    return [
        keep_indivisible_unquantized(modifier, model)
        if isinstance(modifier, QuantizationModifier)
        else modifier
        for modifier in Recipe.create_instance(str(path)).modifiers
    ]


def holds_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and any(
        (directory / name).exists() for name in ("config.json", "model.safetensors")
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="whisper-prune",
        description="Prune a causal LM with a whisper-modifiers or llmcompressor recipe, "
        "report dense and pruned perplexity and pruning time, and save the checkpoint.",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="hub id or local model directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help=f"recipe file or name in recipes/ (default {DEFAULT_RECIPE})",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where to save (default outputs/<model>-<recipe>)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint already in --output-dir"
    )
    parser.add_argument(
        "--calibration",
        default="embedded",
        help="calibration corpus: a text file, 'embedded', 'wikitext2' or 'c4'",
    )
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument(
        "--eval-text",
        default="embedded",
        help="evaluation text: 'embedded', 'wikitext2' (hub test split), a "
        "JSON list of rows (WikiText-2 test_rows.json) or a text file",
    )
    parser.add_argument("--eval-seq-len", type=int, default=1024)
    parser.add_argument(
        "--eval-windows", type=int, default=16, help="evaluate the first N windows (0 = all)"
    )
    parser.add_argument(
        "--eval-bos", action="store_true", help="start every evaluation window with BOS (Gemma)"
    )
    parser.add_argument("--seed", type=int, default=0, help="calibration sampling seed")
    parser.add_argument("--skip-dense-eval", action="store_true")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from whisper_modifiers.models import resolve_model

    recipe = resolve_recipe(args.recipe)
    try:
        model_id = resolve_model(args.model)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from error
    output_dir = args.output_dir or Path("outputs") / (
        f"{Path(model_id.rstrip('/')).name}-{recipe.stem}"
    )
    if holds_checkpoint(output_dir) and not args.overwrite:
        raise UsageError(
            f"{output_dir} already holds a checkpoint; choose another --output-dir or "
            "pass --overwrite"
        )
    for name in ("num_sequences", "seq_len", "eval_seq_len"):
        if getattr(args, name) < (2 if "seq" in name else 1):
            raise UsageError(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")

    from loguru import logger
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from whisper_modifiers.checkpoint import check_checkpoint, sparsity_record, write_record
    from whisper_modifiers.data import calibration_dataset, load_corpus
    from whisper_modifiers.evaluation import evaluation_text, perplexity
    from whisper_modifiers.methods import run_oneshot

    logger.info(f"model {model_id}, recipe {recipe}")
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype="auto")
    calibration = calibration_dataset(
        tokenizer,
        load_corpus(args.calibration, split="train"),
        args.num_sequences,
        args.seq_len,
        seed=args.seed,
    )
    eval_ids = tokenizer(evaluation_text(args.eval_text), add_special_tokens=False)["input_ids"]
    windows = args.eval_windows or None
    bos = tokenizer.bos_token_id if args.eval_bos else None

    def evaluate() -> float:
        model.eval()
        return perplexity(model, eval_ids, args.eval_seq_len, windows, bos, progress=True)

    report = {
        "model": model_id,
        "recipe": str(recipe),
        "calibration": {
            "source": args.calibration,
            "num_sequences": args.num_sequences,
            "seq_len": args.seq_len,
            "seed": args.seed,
        },
        "evaluation": {
            "text": args.eval_text,
            "seq_len": args.eval_seq_len,
            "windows": windows,
            "bos": bos is not None,
        },
    }
    if not args.skip_dense_eval:
        report["dense_perplexity"] = evaluate()
        logger.info(f"dense perplexity {report['dense_perplexity']:.3f}")

    modifiers = load_recipe(recipe, model)
    start = time.perf_counter()
    run_oneshot(model, tokenizer, calibration, modifiers)
    report["pruning_seconds"] = time.perf_counter() - start
    report["pruned_perplexity"] = evaluate()
    record = sparsity_record(
        model,
        modifiers=[type(modifier).__name__ for modifier in modifiers],
        recipe=str(recipe),
        source_model=model_id,
    )
    report["sparsity"] = record["summary"]["sparsity"]

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:  # write next to the target, then rename: never a half-written checkpoint
        model.save_pretrained(partial, save_compressed=True)
        tokenizer.save_pretrained(partial)
        (partial / REPORT_FILE).write_text(json.dumps(report, indent=2))
        write_record(partial, record)
        check_checkpoint(partial)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(partial, output_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    report["output_dir"] = str(output_dir)
    return report


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    try:
        report = run(args)
    except UsageError as error:
        print(f"whisper-prune: error: {error}", file=sys.stderr)
        return 2
    dense = report.get("dense_perplexity")
    print()
    print("| model | recipe | dense ppl | pruned ppl | sparsity | pruning time |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {Path(report['model']).name} | {Path(report['recipe']).stem} | "
        f"{'-' if dense is None else f'{dense:.3f}'} | {report['pruned_perplexity']:.3f} | "
        f"{report['sparsity']:.1%} | {report['pruning_seconds']:.1f} s |"
    )
    print(f"\ncheckpoint: {report['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
