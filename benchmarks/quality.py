"""Quality benchmark: perplexity and pruning time, methods x sparsities x models.

    python benchmarks/quality.py                       # SmolLM2-135M + stories260K, 2:4, 3 seeds
    python benchmarks/quality.py --sparsities 2:4 0.5 0.65 --sweep
    python benchmarks/quality.py --composites --models smollm2-135m --out results/composites
    python benchmarks/quality.py --models smollm2-135m --paper-protocol   # bigger machines
    python benchmarks/quality.py --models smollm2-135m gemma3-270m --sparsities 2:4 0.65 \
        --methods sparsegpt whisper whisper:gamma=auto wanda wisp wisp:gamma=auto \
        wisp_plus:gamma=auto wisp_plus --num-sequences 64 --seq-len 1024 \
        --eval-windows 0 64 --cache runs.json --out benchmarks/results/gamma_auto_gpu

Each (model, method, sparsity) runs with ``--seeds`` seeds (seed = calibration sample and
pair permutation); the table reports mean +- standard error. Writes
``quality.json``, ``quality.md``, ``perplexity_vs_sparsity.png`` (paper Figure 1) and
``perplexity_vs_time.png`` (paper Figure 3, with the Pareto front) to ``--out``; with
``gamma: auto`` variants also the comparison with each baseline (never worse?),
``gamma_auto_ratios.png`` (perplexity over the baseline's) and ``gamma_per_layer.png``,
the chosen gamma per layer. Gemma-3-270M (``gemma3-270m``) is
opt-in: ``bash scripts/install_gemma.sh`` first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    evaluation_ids,
    load,
    model_specs,
    on_evaluation_device,
    quiet_logs,
    spec_perplexity,
    write_json,
)
from quality_report import (  # noqa: E402
    markdown,
    plot,
    plot_baseline_ratios,
    plot_gamma_per_layer,
)
from variant_runs import run_key, run_variants  # noqa: E402

SWEEP = ["0.5", "0.55", "0.6", "0.65", "0.7", "0.75"]
GAMMA_AUTO = [
    "sparsegpt",
    "whisper",
    "whisper:gamma=auto",
    "wanda",
    "wisp",
    "wisp:gamma=auto",
    "wisp_plus:gamma=auto",
    # ablations: the summed squared error, with and without the evidence rule
    "whisper:gamma=auto;gamma_criterion=absolute",
    "wisp:gamma=auto;gamma_criterion=absolute",
    "whisper:gamma=auto;gamma_criterion=absolute;gamma_evidence=0",
    "wisp:gamma=auto;gamma_criterion=absolute;gamma_evidence=0",
    "wisp_plus:gamma=auto;gamma_criterion=absolute;gamma_evidence=0",
]
GAMMA_AUTO_SPARSITIES = ["2:4", "0.65"]


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's flags, with the defaults that depend on others filled in."""
    from whisper_modifiers.methods import COMPOSITE_METHODS, MAIN_METHODS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["stories260K", "smollm2-135m"])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help=f"methods, or variants such as 'whisper:gamma=0.1' (default: "
        f"{' '.join(MAIN_METHODS)})",
    )
    parser.add_argument(
        "--composites",
        action="store_true",
        help="the composability table: RIA, RIA-Wisp, RIA-Wisp+, ALPS, "
        "ALPS-Whisper beside SparseGPT and Whisper",
    )
    parser.add_argument(
        "--gamma-auto",
        action="store_true",
        help=f"issue 14's table: {' '.join(GAMMA_AUTO)} at {' and '.join(GAMMA_AUTO_SPARSITIES)}",
    )
    parser.add_argument("--sparsities", nargs="+", default=None)
    parser.add_argument("--sweep", action="store_true", help=f"add {', '.join(SWEEP)}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--num-sequences", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument(
        "--eval-windows",
        type=int,
        nargs="+",
        default=None,
        help="evaluation windows, one for every model or one per --models entry (0 = all)",
    )
    parser.add_argument(
        "--paper-protocol",
        action="store_true",
        help="128 x 4096 WikiText-2 train calibration, full WikiText-2 test (hub access)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="JSON file of finished runs, read and extended: a run whose protocol, recipe and "
        "seed are already there is not repeated (resumes an interrupted benchmark)",
    )
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="run nothing: tables and plots from the --cache file's finished cells (the "
        "dense perplexity too, once cached)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for every run (default: torch's); recorded with each run. "
        "Float32 reductions, and so SparseGPT's masks, depend on it: compare runs made with "
        "the same count",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.methods is None:
        composites = [*COMPOSITE_METHODS, "sparsegpt", "whisper"]
        args.methods = composites if args.composites else list(MAIN_METHODS)
        args.methods = GAMMA_AUTO if args.gamma_auto else args.methods
    if args.sparsities is None:
        args.sparsities = GAMMA_AUTO_SPARSITIES if args.gamma_auto else ["2:4"]
    if args.eval_windows is not None and len(args.eval_windows) not in (1, len(args.models)):
        parser.error(
            f"--eval-windows takes 1 or {len(args.models)} values (one per model), "
            f"not {len(args.eval_windows)}"
        )
    return args


def run_spec(spec, args: argparse.Namespace, index: int):
    """The model's spec as this run uses it (the paper's protocol, the calibration size
    given), as recorded, and its evaluation windows (None: all)."""
    if args.paper_protocol:
        spec = type(spec)(
            **(
                vars(spec)
                | {
                    "calibration": "wikitext2",
                    "evaluation": "wikitext2",
                    "num_sequences": 128,
                    "seq_len": 4096,
                    "eval_seq_len": 4096,
                    "eval_windows": None,
                }
            )
        )
    spec = type(spec)(
        **(
            vars(spec)
            | {
                "num_sequences": args.num_sequences or spec.num_sequences,
                "seq_len": args.seq_len or spec.seq_len,
            }
        )
    )
    windows = spec.eval_windows
    if args.eval_windows is not None:
        windows = args.eval_windows[index if len(args.eval_windows) > 1 else 0] or None
    return spec, windows


def dense_perplexity(spec, windows, cache: dict, cached_only: bool):
    """The dense model's perplexity (from the cache where a run left it), and the
    tokenizer and evaluation ids (None where nothing was loaded)."""
    dense_key = run_key(spec, windows, [], None)
    tokenizer = eval_ids = None
    if not (cached_only and dense_key in cache):
        model, tokenizer = load(spec)
        eval_ids = evaluation_ids(spec, tokenizer)
        if dense_key not in cache:  # a resumed benchmark does not evaluate it again
            cache[dense_key] = {
                "perplexity": spec_perplexity(
                    on_evaluation_device(model), spec, tokenizer, eval_ids, windows
                )
            }
        del model
    return cache[dense_key]["perplexity"], tokenizer, eval_ids


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    quiet_logs()
    sparsities = list(dict.fromkeys(args.sparsities + (SWEEP if args.sweep else [])))
    specs = model_specs()
    results = {
        "config": vars(args) | {"out": str(args.out), "cache": str(args.cache)},
        "models": {},
    }
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}

    def save_partial():
        write_json(args.out / "quality.json", results)
        if args.cache:
            write_json(args.cache, cache)

    for index, model_name in enumerate(args.models):
        spec, windows = run_spec(specs[model_name], args, index)
        dense, tokenizer, eval_ids = dense_perplexity(spec, windows, cache, args.cached_only)
        print(f"[{model_name}] dense perplexity {dense:.3f}", flush=True)
        entry = results["models"][model_name] = {
            "spec": vars(spec) | {"eval_windows": windows},
            "dense": dense,
            "runs": {},
        }
        run_variants(
            spec,
            tokenizer,
            eval_ids,
            windows,
            args.methods,
            sparsities,
            args.seeds,
            args.num_sequences,
            args.seq_len,
            table=entry["runs"],
            on_cell=save_partial,
            cache=cache,
            cached_only=args.cached_only,
        )
    write_json(args.out / "quality.json", results)
    (args.out / "quality.md").write_text(markdown(results))
    plot(results, args.out)
    plot_gamma_per_layer(results, args.out)
    plot_baseline_ratios(results, args.out)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
