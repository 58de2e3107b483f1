"""Prune stories260K with several methods through ``run_oneshot``, in one process or under
``torchrun``; rank 0 saves the masks, the pairs every rank drew and the perplexities.

    python tests/distributed_worker.py OUT [--batch-size 4] [--pipeline whisper_layerwise]
    torchrun --nproc_per_node 2 tests/distributed_worker.py OUT
    python tests/distributed_worker.py OUT1 --then OUT2 --batch-size 4 --then ...

Runs joined by ``--then`` go one after the other in the same process (or the same
``torchrun``), each with its own options: the imports, about half of a run's time here, are
paid once.

``WHISPER_MODIFIERS_FAIL_RANK=R`` makes rank R raise during calibration (the test that a
failing rank stops the run). ``--slow-rank R`` holds rank R back for a second before each
deferred gamma solve and each of the model check's passes, where another rank could
write weights that the ranks share (``modifiers.distributed``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import CALIBRATION_TEXT, HELDOUT_TEXT, MODEL_DIR  # noqa: E402

METHODS = (
    "wisp",
    "wisp_plus",
    "whisper",
    "sparsegpt",
    "wanda",
    "whisper:gamma=auto",
    "wisp:gamma=auto;gamma_folds=4",
)
"""Methods, with modifier fields after a colon (``name=value`` joined by ``;``)."""
SPARSITIES = (("2:4", 0.5, "2:4"), ("0.5", 0.5, "0:0"))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-sequences", type=int, default=16)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--pipeline", help="oneshot's calibration pipeline (default: its own)")
    parser.add_argument("--attention", default="eager", help="the model's attn_implementation")
    parser.add_argument(
        "--layerwise-attention",
        choices=("auto", "model"),
        help="$WHISPER_LAYERWISE_ATTENTION for this run",
    )
    parser.add_argument("--slow-rank", type=int, help="a rank to hold back (module docstring)")
    return parser


def main(argv: list[str]) -> int:
    """Each ``--then``-separated part of ``argv`` is one run (``parser()``'s options)."""
    parts, part = [], []
    for word in argv:
        if word == "--then":
            parts.append(part)
            part = []
        else:
            part.append(word)
    runs = [parser().parse_args(words) for words in [*parts, part]]

    from whisper_modifiers.modifiers import distributed
    from whisper_modifiers.modifiers.layerwise_pipeline import ATTENTION_VARIABLE

    distributed.init_from_torchrun()
    for args in runs:
        choice = args.layerwise_attention
        attention = mock.patch.dict(os.environ, {ATTENTION_VARIABLE: choice} if choice else {})
        with attention, held_back(args.slow_rank == distributed.rank()):
            results = prune_every_method(args)
        if distributed.rank() == 0:
            torch.save({"world_size": distributed.world_size(), "results": results}, args.out)
    distributed.finish()
    return 0


def prune_every_method(args) -> dict:
    """``args.methods`` at each of ``SPARSITIES``: masks, pairs, perplexity, gamma choices."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from whisper_modifiers.data import calibration_dataset
    from whisper_modifiers.evaluation import perplexity
    from whisper_modifiers.methods import build_recipe, run_oneshot
    from whisper_modifiers.modifiers import distributed

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")[:100_000]
    dataset = calibration_dataset(tokenizer, text, args.num_sequences, 64, seed=0)
    heldout = tokenizer(HELDOUT_TEXT.read_text(encoding="utf-8"))["input_ids"]
    results = {}
    for method in args.methods:
        for label, sparsity, structure in SPARSITIES:
            model = AutoModelForCausalLM.from_pretrained(
                MODEL_DIR, dtype=torch.float32, attn_implementation=args.attention
            )
            name, _, fields = method.partition(":")
            options = dict(field.split("=") for field in fields.split(";") if field)
            recipe = build_recipe(name, sparsity, structure, seed=0, **options)
            pipeline = {"pipeline": args.pipeline} if args.pipeline else {}
            with recorded_pairs() as pairs:
                run_oneshot(
                    model, tokenizer, dataset, recipe, batch_size=args.batch_size, **pipeline
                )
            everyone = [None] * distributed.world_size()
            if distributed.is_distributed():
                dist.all_gather_object(everyone, pairs)
            else:
                everyone = [pairs]
            selection = getattr(recipe[0], "gamma_selection", dict)()
            results[f"{method}/{label}"] = {
                "masks": {
                    name: module.weight.detach() != 0
                    for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear)
                },
                "pairs": {key: value for part in everyone for key, value in part.items()},
                "pairs_per_rank": [len(part) for part in everyone],
                "perplexity": perplexity(model, heldout, 64, 8),
                "gamma": {name: choice["gamma"] for name, choice in selection.items()},
                "model_checks": {
                    name: choice.get("model_check") for name, choice in selection.items()
                },
            }
    return results


@contextlib.contextmanager
def recorded_pairs():
    """Yields a dict into which ``pairing.pair_permutations`` records each draw (by seed);
    on rank ``$WHISPER_MODIFIERS_FAIL_RANK`` a draw raises. The function is restored after."""
    import whisper_modifiers.modifiers.pairing as pairing_module
    from whisper_modifiers.modifiers import distributed

    rank, pairs, drawn = distributed.rank(), {}, pairing_module.pair_permutations

    def recording(seq_len, num_permutations, seed):
        permutations = drawn(seq_len, num_permutations, seed)
        pairs[tuple(seed)] = permutations.clone()
        if rank == int(os.environ.get("WHISPER_MODIFIERS_FAIL_RANK", "-1")):
            raise RuntimeError(f"rank {rank} failed on purpose")
        return permutations

    pairing_module.pair_permutations = recording
    try:
        yield pairs
    finally:
        pairing_module.pair_permutations = drawn


@contextlib.contextmanager
def held_back(here: bool):
    """Where ``here``: sleep a second before ``ModelCheck.defer_choice`` (a solve from the
    dense weights while the other ranks may go on to solve the layer) and before each of the
    model check's loss passes (while the other ranks may swap weights); undone after."""
    import time

    from whisper_modifiers.modifiers import model_check

    if not here:
        yield
        return

    def slowed(function):
        def wrapper(*args, **kwargs):
            time.sleep(1.0)
            return function(*args, **kwargs)

        return wrapper

    defer_choice, sequence_losses = model_check.ModelCheck.defer_choice, model_check.sequence_losses
    model_check.ModelCheck.defer_choice = slowed(defer_choice)
    model_check.sequence_losses = slowed(sequence_losses)
    try:
        yield
    finally:
        model_check.ModelCheck.defer_choice, model_check.sequence_losses = (
            defer_choice,
            sequence_losses,
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
