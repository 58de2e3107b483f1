"""``whisper-prune``: prune a model with a recipe, report perplexity and time, save it.

Before any weights load, every input is checked and a bad one is refused with the flag's
name and exit code 2 (``preflight``): numbers, the recipe, the model's config and
positions, the calibration and evaluation texts (tokenized), recipe patterns against the
model's module names, and the output directory (``output_dir``: only a checkpoint that
whisper-prune wrote is ever replaced, with ``--overwrite``; never ``.``, ``~``, ``/`` or a
directory holding this run's inputs).  Weights holding NaN or inf are refused before
pruning; NaN activations or a NaN pruned perplexity end the run with exit code 1 and
nothing saved.  The checkpoint is written beside the target and renamed into place;
Ctrl-C or SIGTERM leaves nothing behind.

    whisper-prune                                    # Whisper 2:4 on the embedded default
    whisper-prune --model meta-llama/Llama-2-7b-hf --recipe wisp_plus_50 \\
        --calibration wikitext2 --eval-text wikitext2 --num-sequences 128 --seq-len 4096
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from whisper_modifiers.checkpoint import REPORT_FILE
from whisper_modifiers.output_dir import terminate_as_exception
from whisper_modifiers.preflight import (
    UsageError,
    calibration_sequences,
    check_minimum,
    check_positions,
    check_prunable,
    meta_model,
    model_config,
    read_text,
)

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "whisper_2of4"
__all__ = ["REPORT_FILE", "PruningFailed", "UsageError", "main", "parse_args", "run"]


class PruningFailed(Exception):
    """The run was valid but its result is not (NaN activations, NaN perplexity):
    nothing is saved (exit code 1)."""


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def same_file(first: str, second: str) -> bool:
    """Whether two data arguments name one file on disk (hub names never do)."""
    first_path, second_path = Path(first).expanduser(), Path(second).expanduser()
    return first_path.is_file() and second_path.is_file() and first_path.samefile(second_path)


def resolve_recipe(recipe: str) -> Path:
    """A recipe file path, or the name of one in ``recipes/`` (e.g. ``wisp_2of4``)."""
    path = Path(recipe).expanduser()
    if not path.is_file():
        path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise UsageError(
            f"--recipe {recipe!r} is neither a file nor one of: {', '.join(available_recipes())}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--recipe {path} cannot be read: {error}") from error
    if not text.strip():
        raise UsageError(f"--recipe {path} is empty: it must define at least one modifier")
    from llmcompressor.recipe import Recipe

    import whisper_modifiers  # noqa: F401  (registers our modifiers by name)

    try:
        modifiers = Recipe.create_instance(str(path)).modifiers
    except Exception as error:  # a YAML or modifier error, shown as the user's problem
        raise UsageError(f"--recipe {path} cannot be used: {error}") from error
    if not modifiers:
        raise UsageError(
            f"--recipe {path} defines no modifier (stages are keys ending in '_stage', "
            "holding groups ending in '_modifiers'; see recipes/whisper_2of4.yaml)"
        )
    return path


def load_recipe(path: Path, model) -> list:
    """The recipe's modifiers; a group-wise quantization scheme (W4A16) leaves the layers
    it cannot quantize in 16-bit, with a warning, rather than failing mid-run. ``model``
    may be a meta-device model (only module names and shapes are read)."""
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.recipe import Recipe
    from loguru import logger

    from whisper_modifiers.quantization import keep_indivisible_unquantized

    modifiers = []
    for modifier in Recipe.create_instance(str(path)).modifiers:
        if isinstance(modifier, (QuantizationModifier, GPTQModifier)):
            modifier = keep_indivisible_unquantized(modifier, model)
        if isinstance(modifier, GPTQModifier) and not list(
            match_named_modules(model, ["Linear"], modifier.ignore)
        ):  # GPTQ refuses to run with nothing to quantize
            logger.warning(f"{type(modifier).__name__} has no layer left to quantize: skipped")
            continue
        modifiers.append(modifier)
    return modifiers


def check_prune_then_quantize(modifiers: list) -> None:
    """Refuse a quantization modifier before a pruning one: pruning would then zero
    quantized weights under scales fitted to the dense ones (or, for a packed scheme,
    find no float weight to prune)."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.pruning.sparsegpt.sgpt_base import SparsityModifierBase
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from whisper_modifiers.modifiers import OneShotMagnitudeModifier

    quantizing = (QuantizationModifier, GPTQModifier)
    pruning = (SparsityModifierBase, OneShotMagnitudeModifier)
    for index, modifier in enumerate(modifiers):
        later = [m for m in modifiers[index + 1 :] if isinstance(m, pruning)]
        if isinstance(modifier, quantizing) and later:
            raise ValueError(
                f"{type(modifier).__name__} comes before {type(later[0]).__name__}; prune "
                "first, then quantize (put the quantization modifier after the pruning one)"
            )


def check_recipe_targets(path: Path, modifiers: list, model, num_sequences: int) -> None:
    """Resolve every ``difference_targets`` of the recipe against ``model``'s modules,
    refuse a stock GPTQ after pruning (``check_mask_kept``) and a ``gamma: auto`` with
    no held-out sequence."""
    from whisper_modifiers.modifiers import check_mask_kept

    try:
        check_mask_kept(modifiers)
        check_prune_then_quantize(modifiers)
    except ValueError as error:
        raise UsageError(f"--recipe {path}: {error}") from error
    for modifier in modifiers:
        if hasattr(modifier, "check_difference_targets"):
            try:
                modifier.check_difference_targets(model)
                modifier.check_calibration_size(num_sequences)
            except ValueError as error:
                raise UsageError(f"--recipe {path}: {type(modifier).__name__}: {error}") from error


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
    parser.add_argument(
        "--layout",
        choices=("auto", "compressed", "dense"),
        default="auto",
        help="how 2:4 weights are stored: 'compressed' (half the values plus a 4-bit-per-"
        "group bitmask, served by this package's vLLM plugin), 'dense' (zeros stored, "
        "any loader), 'auto' (default: compressed for a 2:4 recipe that is unquantized or "
        "quantized to 8 bits, else dense)",
    )
    parser.add_argument(
        "--offload-device",
        default="auto",
        help="where llmcompressor's sequential pipeline keeps the cached activations "
        "between layers: 'cpu', 'cuda' (fast; needs GPU memory) or 'auto' (default: the GPU "
        "when the cache takes at most 40%% of its free memory)",
    )
    parser.add_argument(
        "--batch-size",
        default="auto",
        help="calibration sequences per forward: a number, or 'auto' (default: 1, so that "
        "masks never depend on the machine; larger batches change the forward's rounding)",
    )
    return parser.parse_args(argv)


def storage_layout(layout: str, modifiers: list) -> str:
    """``--layout`` resolved: ``compressed`` needs a 2:4 recipe, unquantized or quantized
    to one 8-bit value per weight (W8A8, FP8); 4-bit packed weights keep the dense layout."""
    from llmcompressor.modifiers.quantization.quantization.mixin import QuantizationMixin

    two_four = any(getattr(m, "mask_structure", None) == "2:4" for m in modifiers)
    quantizers = [m for m in modifiers if isinstance(m, QuantizationMixin)]
    packed = any(
        group.weights is not None and group.weights.num_bits != 8
        for m in quantizers
        for group in m.resolved_config.config_groups.values()
    )
    if layout == "auto":
        return "compressed" if two_four and not packed else "dense"
    if layout == "compressed" and (packed or not two_four):
        raise UsageError(
            "--layout compressed stores 2:4 weights unquantized or as 8-bit values: the "
            + (
                "recipe packs weights to fewer bits (W4A16 keeps compressed-tensors' layout)"
                if packed
                else "recipe has no mask_structure '2:4' modifier"
            )  # fmt: skip
        )
    return layout


def two_four_layers(model, modifiers: list) -> list[str]:
    """Names of the Linear modules that the recipe's 2:4 modifiers prune."""
    import torch
    from compressed_tensors.utils import match_named_modules, match_targets

    names = []
    for modifier in modifiers:
        if getattr(modifier, "mask_structure", None) != "2:4":
            continue
        ignore = list(modifier.ignore or [])
        for name, module in match_named_modules(model, modifier.targets, ignore):
            inner = [(name, module)] if isinstance(module, torch.nn.Linear) else [
                (f"{name}.{n}", m) for n, m in module.named_modules()
                if isinstance(m, torch.nn.Linear)
            ]  # fmt: skip
            names += [n for n, m in inner if not match_targets(n, m, ignore)]
    return sorted(set(names))


# flag -> (minimum, what it is)
MINIMUMS = {
    "num_sequences": (1, "calibration sequences"),
    "seq_len": (2, "pairs are formed within a sequence"),
    "eval_seq_len": (2, "a window predicts its tokens after the first"),
    "eval_windows": (0, "0 evaluates every window"),
    "seed": (0, "a torch generator seed"),
}


def check_batch_size(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UsageError(
            f"--batch-size must be 'auto' or a whole number of at least 1; got {value!r}"
        )
    return number


def check_offload_device(value: str) -> str:
    import torch

    if value in ("auto", "cpu"):
        return value
    try:
        device = torch.device(value)
    except RuntimeError:
        device = None
    if device is None or device.type != "cuda":
        raise UsageError(f"--offload-device must be 'auto', 'cpu' or a CUDA device; got {value!r}")
    if not torch.cuda.is_available():
        raise UsageError(f"--offload-device {value}: no CUDA device here (use 'cpu' or 'auto')")
    return value


def run(args: argparse.Namespace) -> dict:
    """Check everything that can be checked before loading weights, then load, prune,
    evaluate and save (see the module docstring)."""
    started = time.time()
    for name, (minimum, meaning) in MINIMUMS.items():
        check_minimum(f"--{name.replace('_', '-')}", getattr(args, name), minimum, meaning)
    recipe = resolve_recipe(args.recipe)
    batch_size = check_batch_size(args.batch_size)
    offload_device = check_offload_device(args.offload_device)
    from whisper_modifiers.modifiers import distributed

    distributed.init_from_torchrun()  # under torchrun: join the process group
    writer = distributed.rank() == 0  # only rank 0 evaluates and writes
    if args.num_sequences < distributed.world_size():
        raise UsageError(
            f"--num-sequences {args.num_sequences} cannot be split over "
            f"{distributed.world_size()} processes: each needs at least one sequence"
        )

    from whisper_modifiers.models import resolve_model
    from whisper_modifiers.output_dir import (
        OutputDirError,
        check_output_dir,
        remove_stale_partials,
    )

    try:
        model_id = resolve_model(args.model)
    except FileNotFoundError as error:
        raise UsageError(f"--model: {error}") from error
    output_dir = args.output_dir or Path("outputs") / (
        f"{Path(model_id.rstrip('/')).name}-{recipe.stem}"
    )
    inputs = [p for p in (model_id, args.calibration, args.eval_text) if Path(p).exists()]
    try:
        output_dir = check_output_dir(output_dir, inputs, args.overwrite)
    except OutputDirError as error:
        raise UsageError(str(error)) from error
    config = model_config(model_id)
    check_positions(config, **{"--seq-len": args.seq_len, "--eval-seq-len": args.eval_seq_len})

    from loguru import logger
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from whisper_modifiers.checkpoint import (
        check_checkpoint,
        sparsity_record,
        strict_json,
        write_record,
    )
    from whisper_modifiers.data import load_corpus, sequence_dataset
    from whisper_modifiers.evaluation import evaluation_text, evaluation_windows, perplexity
    from whisper_modifiers.methods import calibration_settings, gamma_selection, run_oneshot
    from whisper_modifiers.modifiers.validation import NonFiniteError, check_finite_weights
    from whisper_modifiers.output_dir import partial_output
    from whisper_modifiers.sparse_serving.checkpoint import write_dense_layout, write_sparse24

    calibration_text = read_text(
        "--calibration", args.calibration, lambda s: load_corpus(s, split="train")
    )
    eval_text = read_text("--eval-text", args.eval_text, evaluation_text)
    if same_file(args.calibration, args.eval_text):
        logger.warning(f"--calibration and --eval-text are the same file ({args.eval_text}): "
                       "the perplexity is measured on the calibration text, so it flatters "
                       "every method that fits it")  # fmt: skip
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"--model {model_id}: its tokenizer cannot be loaded: {error}") from error
    sequences = calibration_sequences(tokenizer, calibration_text, args.calibration,
                                      args.num_sequences, args.seq_len, args.seed)  # fmt: skip
    eval_ids = tokenizer(eval_text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id if args.eval_bos else None
    windows = args.eval_windows or None
    try:
        num_windows = len(evaluation_windows(eval_ids, args.eval_seq_len, windows, bos))
    except ValueError as error:
        raise UsageError(
            f"--eval-text {args.eval_text!r} is too short for one --eval-seq-len "
            f"{args.eval_seq_len} window: {error}; it needs at least "
            f"{args.eval_seq_len - (bos is not None)} tokens"
        ) from error
    if windows and num_windows < windows:
        logger.warning(f"--eval-windows {windows}: --eval-text holds {num_windows} windows of "
                       f"{args.eval_seq_len} tokens; evaluating those")  # fmt: skip
    skeleton = meta_model(config)
    modifiers = load_recipe(recipe, skeleton)
    check_recipe_targets(recipe, modifiers, skeleton, args.num_sequences)
    layout = storage_layout(args.layout, modifiers)
    for stale in remove_stale_partials(output_dir, started) if writer else ():
        logger.info(f"removed {stale}, left by an interrupted whisper-prune")

    logger.info(f"model {model_id}, recipe {recipe}")
    load_from, scratch = model_id, None
    if check_prunable(model_id, config):  # our compressed 2:4 checkpoint: its dense layout
        scratch = tempfile.TemporaryDirectory(prefix="whisper-prune-dense-")  # lives for run
        load_from = str(write_dense_layout(model_id, scratch.name))
        logger.info(f"--model {model_id} is a compressed 2:4 checkpoint: pruning its dense "
                    "weights (a temporary copy in the dense layout)")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(load_from, dtype="auto")
    try:
        check_finite_weights(model)
    except NonFiniteError as error:
        raise UsageError(f"--model {model_id}: {error}") from error
    calibration = sequence_dataset(sequences)

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
            "windows": num_windows,  # evaluated, which may be fewer than --eval-windows
            "bos": bos is not None,
        },
    }
    if distributed.is_distributed():
        bounds = distributed.shard_bounds(len(calibration), distributed.world_size())
        report["distributed"] = {
            "world_size": distributed.world_size(),
            "sequences_per_rank": [end - start for start, end in bounds],
        }
    if not args.skip_dense_eval and writer:
        report["dense_perplexity"] = evaluate()
        logger.info(f"dense perplexity {report['dense_perplexity']:.3f}")

    offload_device, batch_size = calibration_settings(
        model, args.num_sequences, args.seq_len, offload_device, batch_size
    )
    report["calibration"].update(batch_size=batch_size, offload_device=offload_device)
    logger.info(f"calibration batch size {batch_size}, activation cache on {offload_device}")
    start = time.perf_counter()
    try:
        run_oneshot(model, tokenizer, calibration, modifiers, batch_size=batch_size,
                    sequential_offload_device=offload_device)  # fmt: skip
    except NonFiniteError as error:
        raise PruningFailed(f"pruning stopped: {error}") from error
    report["pruning_seconds"] = time.perf_counter() - start
    distributed.finish()
    if not writer:
        return report  # rank 0 evaluates and saves the same weights
    report["pruned_perplexity"] = evaluate()
    if not math.isfinite(report["pruned_perplexity"]):
        raise PruningFailed(
            f"the pruned model's perplexity is {report['pruned_perplexity']}: it is broken "
            f"(NaN or inf logits), so it is not saved to {output_dir}"
        )
    gamma_choices = gamma_selection(modifiers)
    record = sparsity_record(
        model,
        modifiers=[type(modifier).__name__ for modifier in modifiers],
        recipe=str(recipe),
        source_model=model_id,
        **({"gamma_selection": gamma_choices} if gamma_choices else {}),
    )
    report["sparsity"] = record["summary"]["sparsity"]

    try:  # the directory may have changed during pruning
        check_output_dir(output_dir, inputs, args.overwrite)
    except OutputDirError as error:
        raise UsageError(f"{error} (it changed while this run was pruning)") from error
    report["layout"] = layout
    two_four = two_four_layers(model, modifiers)
    with partial_output(output_dir) as partial:  # never a half-written checkpoint
        model.save_pretrained(partial, save_compressed=True)
        if layout == "compressed":
            try:  # checks every layer is exactly 2:4 before it writes anything
                report["compressed_2of4"] = write_sparse24(partial, two_four)
            except ValueError as error:
                raise PruningFailed(f"cannot store the compressed 2:4 layout: {error}") from error
        tokenizer.save_pretrained(partial)
        (partial / REPORT_FILE).write_text(strict_json(report))
        write_record(partial, record)
        check_checkpoint(partial, unfinished_ok=True)
    report["output_dir"] = str(output_dir)
    return report


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    try:
        with terminate_as_exception():  # SIGTERM cleans up like Ctrl-C
            report = run(args)
    except UsageError as error:
        print(f"whisper-prune: error: {error}", file=sys.stderr)
        return 2
    except PruningFailed as error:
        print(f"whisper-prune: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        print(f"whisper-prune: error: no space left on the device while writing the "
              f"checkpoint ({error.filename or args.output_dir}); nothing was kept: free "
              "space or choose another --output-dir", file=sys.stderr)  # fmt: skip
        return 1
    if "output_dir" not in report:
        return 0  # another rank of a torchrun run: rank 0 reports and saves
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
