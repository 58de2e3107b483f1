"""A whisper-prune run checked before any weights load (``check_inputs``): every flag,
the model and output directory, the calibration and evaluation texts (tokenized), and the
recipe against a meta-device model, a bad one refused with ``UsageError`` naming it; the
``Plan`` that ``cli.prune_and_save`` then carries out."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger
from transformers import AutoTokenizer

# modules, not their functions: the tests replace these functions to inject faults
from whisper_modifiers import evaluation, methods
from whisper_modifiers.data import load_corpus
from whisper_modifiers.models import resolve_model
from whisper_modifiers.modifiers import distributed
from whisper_modifiers.output_dir import OutputDirError, check_output_dir
from whisper_modifiers.preflight import (
    MINIMUMS,
    UsageError,
    calibration_sequences,
    check_batch_size,
    check_minimum,
    check_offload_device,
    check_positions,
    meta_model,
    model_config,
    read_text,
    same_file,
)
from whisper_modifiers.recipes import (
    check_recipe_targets,
    load_recipe,
    resolve_recipe,
    storage_layout,
)

__all__ = ["Plan", "check_inputs"]


@dataclass
class Plan:
    """A whisper-prune run whose every input was checked (``check_inputs``): what
    ``cli.prune_and_save`` does, with no weights loaded yet."""

    args: argparse.Namespace
    started: float  # time.time() at the start, for the stale partial outputs
    model_id: str
    config: object  # the model's transformers config
    output_dir: Path
    inputs: list[str]  # the files this run reads, which the output may not touch
    writer: bool  # rank 0: evaluates and writes
    batch_size: int | str
    offload_device: str
    pipeline: str  # PIPELINE_NAME, "sequential" or "auto" (chosen once the model is loaded)
    recipe: Path  # readable and non-empty; parsed by check_inputs
    modifiers: list = field(default_factory=list)
    layout: str = "dense"
    tokenizer: object = None
    sequences: list = field(default_factory=list)
    eval_ids: list = field(default_factory=list)
    bos: int | None = None
    windows: int | None = None  # --eval-windows, None for all
    num_windows: int = 0  # the windows evaluated


def check_inputs(args: argparse.Namespace) -> Plan:
    """Everything that can be checked before loading weights, in the order a user would
    fix it: the flags, the model and output directory, the texts (tokenized), the recipe
    against a meta-device model; a bad one raises ``UsageError`` naming it."""
    plan = _check_flags(args)
    _tokenize_texts(plan)
    skeleton = meta_model(plan.config)
    plan.modifiers = load_recipe(plan.recipe, skeleton)
    check_recipe_targets(plan.recipe, plan.modifiers, skeleton, args.num_sequences)
    plan.layout = storage_layout(args.layout, plan.modifiers)
    return plan


def _check_flags(args: argparse.Namespace) -> Plan:
    started = time.time()
    for name, (minimum, meaning) in MINIMUMS.items():
        check_minimum(f"--{name.replace('_', '-')}", getattr(args, name), minimum, meaning)
    recipe = resolve_recipe(args.recipe)  # a missing or empty recipe, before other work
    batch_size = check_batch_size(args.batch_size)
    offload_device = check_offload_device(args.offload_device)
    try:
        methods.calibration_pipeline(args.pipeline)  # a bad choice, before any work
        pipeline = args.pipeline
    except ValueError as error:  # $WHISPER_LAYERWISE_ATTENTION
        raise UsageError(f"--pipeline {args.pipeline}: {error}") from error
    distributed.init_from_torchrun()  # under torchrun: join the process group
    if args.num_sequences < distributed.world_size():
        raise UsageError(
            f"--num-sequences {args.num_sequences} cannot be split over "
            f"{distributed.world_size()} processes: each needs at least one sequence"
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
    return Plan(
        args,
        started,
        model_id,
        config,
        output_dir,
        inputs,
        distributed.rank() == 0,
        batch_size,
        offload_device,
        pipeline,
        recipe,
    )


def _tokenize_texts(plan: Plan) -> None:
    """The calibration sequences and evaluation windows, refused if too short."""
    args = plan.args
    calibration_text = read_text(
        "--calibration", args.calibration, lambda s: load_corpus(s, split="train")
    )
    eval_text = read_text("--eval-text", args.eval_text, evaluation.evaluation_text)
    if same_file(args.calibration, args.eval_text):
        logger.warning(
            f"--calibration and --eval-text are the same file ({args.eval_text}): "
            "the perplexity is measured on the calibration text, so it flatters "
            "every method that fits it"
        )
    try:
        plan.tokenizer = AutoTokenizer.from_pretrained(plan.model_id)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(
            f"--model {plan.model_id}: its tokenizer cannot be loaded: {error}"
        ) from error
    plan.sequences = calibration_sequences(
        plan.tokenizer,
        calibration_text,
        args.calibration,
        args.num_sequences,
        args.seq_len,
        args.seed,
    )
    plan.bos = plan.tokenizer.bos_token_id if args.eval_bos else None
    plan.windows = args.eval_windows or None
    body = evaluation.window_body(args.eval_seq_len, plan.bos)
    plan.eval_ids = evaluation.leading_token_ids(
        plan.tokenizer, eval_text, plan.windows * body if plan.windows else None
    )
    try:
        plan.num_windows = len(
            evaluation.evaluation_windows(plan.eval_ids, args.eval_seq_len, plan.windows, plan.bos)
        )
    except ValueError as error:
        raise UsageError(
            f"--eval-text {args.eval_text!r} is too short for one --eval-seq-len "
            f"{args.eval_seq_len} window: {error}; it needs at least "
            f"{body} tokens"
        ) from error
    if plan.windows and plan.num_windows < plan.windows:
        logger.warning(
            f"--eval-windows {plan.windows}: --eval-text holds {plan.num_windows} "
            f"windows of {args.eval_seq_len} tokens; evaluating those"
        )
