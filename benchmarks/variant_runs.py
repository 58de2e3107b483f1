"""The quality benchmarks' runs: a method variant parsed from its text, and every
(sparsity, variant, seed) pruned and evaluated once (``run_variants``, with a cache keyed by
``run_key``), as mean +- standard error over the seeds."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ModelSpec,
    calibration_set,
    load,
    on_evaluation_device,
    prune,
    spec_perplexity,
)


def parse_variant(text: str) -> tuple[str, dict]:
    """``"whisper"`` or ``"whisper:gamma=0.1;pairing=centered"`` -> (method, options).
    Option values are read as YAML (numbers, strings, ``[lists]``)."""
    import yaml

    from whisper_modifiers.methods import METHODS

    method, _, rest = text.partition(":")
    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r} in {text!r}; known: {', '.join(METHODS)}")
    options = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        options[key.strip()] = yaml.safe_load(value)
    return method, options


def run_key(spec: ModelSpec, windows, recipe, seed: int) -> str:
    """What decides a run's result: the protocol, every field of the recipe's modifiers
    (defaults included, so ``whisper`` and ``whisper:num_permutations=1`` are one run),
    and the seed."""
    modifiers = [[type(m).__name__, m.model_dump(mode="json")] for m in recipe]
    return json.dumps([vars(spec), windows, modifiers, seed], sort_keys=True, default=str)


def run_variants(
    spec,
    tokenizer,
    eval_ids,
    windows,
    variants,
    sparsity_labels,
    seeds,
    num_sequences=None,
    seq_len=None,
    table=None,
    on_cell=None,
    cache=None,
    cached_only=False,
) -> dict:
    """Prune and evaluate every (sparsity, variant, seed) into ``table``
    (``{sparsity label: {variant: cell}}``, a cell holding the runs and mean +- s.e.m.);
    ``on_cell()`` is called after each cell and each new run. ``cache`` (a dict,
    ``run_key`` -> run) holds runs already done: a variant that builds the same recipe as
    one run before is not run again. With ``cached_only`` nothing is run: a cell whose
    runs are not all in ``cache`` is left out (tables from an interrupted benchmark)."""
    import torch

    from whisper_modifiers.methods import build_recipe
    from whisper_modifiers.saving import gamma_selection

    table = {} if table is None else table
    cache = {} if cache is None else cache
    for label in sparsity_labels:
        sparsity, structure = parse_sparsity(label)
        for variant in variants:
            method, options = parse_variant(variant)
            runs = []
            for seed in range(seeds):
                recipe = build_recipe(method, sparsity, structure, seed, **options)
                key = run_key(spec, windows, recipe, seed)
                if key not in cache and cached_only:
                    break
                if key not in cache:
                    model, _ = load(spec)
                    dataset = calibration_set(spec, tokenizer, seed, num_sequences, seq_len)
                    seconds, memory = prune(model, tokenizer, dataset, recipe)
                    model = on_evaluation_device(model)
                    ppl = spec_perplexity(model, spec, tokenizer, eval_ids, windows)
                    selection = gamma_selection(recipe)  # gamma: auto's record, if any
                    gammas = {name: choice["gamma"] for name, choice in selection.items()}
                    cache[key] = {
                        "seed": seed,
                        "perplexity": ppl,
                        "seconds": seconds,
                        "peak_bytes": memory,
                        "gamma": gammas,
                        "selection": selection,
                        "threads": torch.get_num_threads(),
                    }
                    if on_cell is not None:
                        on_cell()  # the cache keeps each finished run
                runs.append(cache[key])
                print(
                    f"[{spec.name}] {label:>5} {variant} seed {seed}: ppl "
                    f"{runs[-1]['perplexity']:.3f}  {runs[-1]['seconds']:.1f} s",
                    flush=True,
                )
            if len(runs) < seeds:  # cached_only, and some seed was not run
                continue
            ppl_mean, ppl_sem = mean_sem([r["perplexity"] for r in runs])
            time_mean, time_sem = mean_sem([r["seconds"] for r in runs])
            table.setdefault(label, {})[variant] = {
                "runs": runs,
                "perplexity": ppl_mean,
                "perplexity_sem": ppl_sem,
                "seconds": time_mean,
                "seconds_sem": time_sem,
            }
            if on_cell is not None:
                on_cell()
    return table


def parse_sparsity(label: str) -> tuple[float, str]:
    """``"2:4"`` -> (0.5, "2:4"); ``"0.65"`` -> (0.65, "0:0")."""
    if ":" in label:
        n, m = (int(x) for x in label.split(":"))
        return n / m, label
    return float(label), "0:0"


def mean_sem(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    sem = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return mean, sem
