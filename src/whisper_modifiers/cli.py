"""``whisper-prune``: prune a model with a recipe, report perplexity and time, save it.

Before any weights load, every input is checked and a bad one is refused with the flag's
name and exit code 2 (``preflight``): numbers, the recipe, the model's config and
positions, the calibration and evaluation texts (tokenized), recipe patterns against the
model's module names, and the output directory (``output_dir``: only a checkpoint that
whisper-prune wrote is ever replaced, with ``--overwrite``; never ``.``, ``~``, ``/`` or a
directory holding this run's inputs).  Weights holding NaN or inf are refused before
pruning; NaN activations or a NaN pruned perplexity end the run with exit code 1 and
nothing saved.  The checkpoint is written beside the target and renamed into place;
Ctrl-C or SIGTERM leaves nothing behind. The checks and the checked run they give live in
``prune_plan``; this module declares the flags, carries the run out and reports it.

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

from loguru import logger
from transformers import AutoModelForCausalLM

# modules, not their functions: the tests replace these functions to inject faults
from whisper_modifiers import checkpoint, evaluation, methods, saving
from whisper_modifiers.data import sequence_dataset
from whisper_modifiers.modifiers import PIPELINE_NAME, distributed
from whisper_modifiers.modifiers.validation import NonFiniteError, check_finite_weights
from whisper_modifiers.output_dir import (
    OutputDirError,
    check_output_dir,
    partial_output,
    remove_stale_partials,
    terminate_as_exception,
)
from whisper_modifiers.preflight import UsageError, check_prunable
from whisper_modifiers.prune_plan import Plan, check_inputs
from whisper_modifiers.recipes import DEFAULT_RECIPE
from whisper_sparse.format.checkpoint import REPORT_FILE, check_checkpoint
from whisper_sparse.format.layout import write_dense_layout

__all__ = [
    "REPORT_FILE",
    "Plan",
    "PruningFailed",
    "UsageError",
    "check_inputs",
    "main",
    "parse_args",
    "prune_and_save",
]


class PruningFailed(Exception):
    """The run was valid but its result is not (NaN activations, NaN perplexity):
    nothing is saved (exit code 1)."""


def parse_args(argv=None) -> argparse.Namespace:
    """whisper-prune's flags (one declaration each, hence the length)."""
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
        help="how pruned weights are stored: 'compressed' (2:4 layers as half the values "
        "plus a bitmask, others as their kept values, a bitmask and row offsets where that "
        "is smaller; served by this package's vLLM plugin), 'dense' (zeros stored, any "
        "loader), 'auto' (default: compressed for a pruning recipe that is unquantized or "
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
    parser.add_argument(
        "--pipeline",
        choices=methods.PIPELINE_CHOICES,
        default="auto",
        help=f"calibration pipeline: '{PIPELINE_NAME}' (this package's, decoder layer by "
        "decoder layer with SDPA attention on a GPU), 'sequential' (oneshot's default: "
        f"llmcompressor's sequential pipeline) or 'auto' (default: {PIPELINE_NAME} on a GPU, "
        "sequential on a CPU)",
    )
    return parser.parse_args(argv)


def prune_and_save(plan: Plan) -> dict:
    """Load, prune, evaluate and save a checked run (see the module docstring); returns
    the report (rank 0's holds ``output_dir``)."""
    for stale in remove_stale_partials(plan.output_dir, plan.started) if plan.writer else ():
        logger.info(f"removed {stale}, left by an interrupted whisper-prune")
    logger.info(f"model {plan.model_id}, recipe {plan.recipe}")
    # a compressed 2:4 source is read through a dense copy, which llmcompressor may read
    # again (its config, processor) during the run
    scratch = tempfile.TemporaryDirectory(prefix="whisper-prune-dense-")
    model = _load_model(plan, scratch.name)
    report = _report(plan)

    def evaluate() -> float:
        model.eval()
        args = (model, plan.eval_ids, plan.args.eval_seq_len, plan.windows, plan.bos)
        return evaluation.perplexity(*args, progress=True)

    if not plan.args.skip_dense_eval and plan.writer:
        report["dense_perplexity"] = evaluate()
        logger.info(f"dense perplexity {report['dense_perplexity']:.3f}")
    offload_device, batch_size = methods.calibration_settings(
        model, plan.args.num_sequences, plan.args.seq_len, plan.offload_device, plan.batch_size
    )
    pipeline = methods.calibration_pipeline(plan.pipeline)
    report["calibration"].update(
        batch_size=batch_size, offload_device=offload_device, pipeline=pipeline
    )
    chosen = " (--pipeline auto)" if plan.pipeline == "auto" else ""
    logger.info(
        f"calibration pipeline {pipeline}{chosen}, batch size {batch_size}, activation "
        f"cache on {offload_device}"
    )
    ours = {"pipeline": PIPELINE_NAME} if pipeline == PIPELINE_NAME else {}
    start = time.perf_counter()
    try:
        methods.run_oneshot(
            model,
            plan.tokenizer,
            sequence_dataset(plan.sequences),
            plan.modifiers,
            batch_size=batch_size,
            sequential_offload_device=offload_device,
            **ours,
        )
    except NonFiniteError as error:
        raise PruningFailed(f"pruning stopped: {error}") from error
    report["pruning_seconds"] = time.perf_counter() - start
    distributed.finish()
    if not plan.writer:
        return report  # rank 0 evaluates and saves the same weights
    report["pruned_perplexity"] = evaluate()
    if not math.isfinite(report["pruned_perplexity"]):
        raise PruningFailed(
            f"the pruned model's perplexity is {report['pruned_perplexity']}: it is broken "
            f"(NaN or inf logits), so it is not saved to {plan.output_dir}"
        )
    _save(plan, model, report)
    return report


def _load_model(plan: Plan, scratch: str):
    """The model's weights (our compressed 2:4 checkpoint through a dense-layout copy in
    ``scratch``), refused if any holds NaN or inf."""
    load_from = plan.model_id
    if check_prunable(plan.model_id, plan.config):  # our compressed 2:4 checkpoint
        load_from = str(write_dense_layout(plan.model_id, scratch))
        logger.info(
            f"--model {plan.model_id} is a compressed 2:4 checkpoint: pruning its "
            "dense weights (a temporary copy in the dense layout)"
        )
    model = AutoModelForCausalLM.from_pretrained(load_from, dtype="auto")
    try:
        check_finite_weights(model)
    except NonFiniteError as error:
        raise UsageError(f"--model {plan.model_id}: {error}") from error
    return model


def _report(plan: Plan) -> dict:
    args = plan.args
    report = {
        "model": plan.model_id,
        "recipe": str(plan.recipe),
        "calibration": {
            "source": args.calibration,
            "num_sequences": args.num_sequences,
            "seq_len": args.seq_len,
            "seed": args.seed,
        },
        "evaluation": {
            "text": args.eval_text,
            "seq_len": args.eval_seq_len,
            "windows": plan.num_windows,  # evaluated, which may be fewer than --eval-windows
            "bos": plan.bos is not None,
        },
    }
    if distributed.is_distributed():
        bounds = distributed.shard_bounds(len(plan.sequences), distributed.world_size())
        report["distributed"] = {
            "world_size": distributed.world_size(),
            "sequences_per_rank": [end - start for start, end in bounds],
        }
    return report


def _save(plan: Plan, model, report: dict) -> None:
    """The checkpoint (``saving.write_checkpoint``, the code path of llmcompressor's own
    save under our modifiers), its tokenizer and report, written beside ``output_dir``
    and renamed into place (``partial_output``)."""
    details = {"recipe": str(plan.recipe), "source_model": plan.model_id}
    try:  # the directory may have changed during pruning
        check_output_dir(plan.output_dir, plan.inputs, plan.args.overwrite)
    except OutputDirError as error:
        raise UsageError(f"{error} (it changed while this run was pruning)") from error
    report["layout"] = plan.layout
    with partial_output(plan.output_dir) as partial:  # never a half-written checkpoint
        try:  # checks every 2:4 layer is exactly 2:4 before it writes anything
            written = saving.write_checkpoint(
                model,
                partial,
                plan.modifiers,
                saving.llmcompressor_save(model),
                plan.layout,
                **details,
            )
        except ValueError as error:  # NotTwoFourError, or a format it cannot hold
            raise PruningFailed(f"cannot store the compressed layout: {error}") from error
        report["sparsity"] = written["record"]["summary"]["sparsity"]
        if written["compressed"] is not None:
            report["compressed"] = written["compressed"]
        plan.tokenizer.save_pretrained(partial)
        (partial / REPORT_FILE).write_text(checkpoint.strict_json(report))
        check_checkpoint(partial, unfinished_ok=True)
    report["output_dir"] = str(plan.output_dir)


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    try:
        with terminate_as_exception():  # SIGTERM cleans up like Ctrl-C
            report = prune_and_save(check_inputs(args))
    except UsageError as error:
        print(f"whisper-prune: error: {error}", file=sys.stderr)
        return 2
    except PruningFailed as error:
        print(f"whisper-prune: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        print(
            f"whisper-prune: error: no space left on the device while writing the "
            f"checkpoint ({error.filename or args.output_dir}); nothing was kept: free "
            "space or choose another --output-dir",
            file=sys.stderr,
        )
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
    print(f"\ncheckpoint: {report['output_dir']}{_size_note(report)}")
    return 0


def _size_note(report: dict) -> str:
    """`` (N GiB of weights, r x the dense layout)`` of a compressed checkpoint."""
    sizes = report.get("compressed")
    if not sizes:
        return ""
    stored, dense = sizes["checkpoint_bytes"], sizes["dense_checkpoint_bytes"]
    return f" ({stored / 2**30:.2f} GiB of weights, {stored / dense:.2f}x the dense layout)"


if __name__ == "__main__":
    sys.exit(main())
