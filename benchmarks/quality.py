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
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    evaluation_ids,
    load,
    model_specs,
    on_evaluation_device,
    quiet_logs,
    run_key,
    run_variants,
    spec_perplexity,
    write_json,
)

SWEEP = ["0.5", "0.55", "0.6", "0.65", "0.7", "0.75"]
GAMMA_AUTO = ["sparsegpt", "whisper", "whisper:gamma=auto", "wanda", "wisp", "wisp:gamma=auto",
              "wisp_plus:gamma=auto",
              # ablations: the summed squared error, with and without the evidence rule
              "whisper:gamma=auto;gamma_criterion=absolute",
              "wisp:gamma=auto;gamma_criterion=absolute",
              "whisper:gamma=auto;gamma_criterion=absolute;gamma_evidence=0",
              "wisp:gamma=auto;gamma_criterion=absolute;gamma_evidence=0",
              "wisp_plus:gamma=auto;gamma_criterion=absolute;gamma_evidence=0"]  # fmt: skip
GAMMA_AUTO_SPARSITIES = ["2:4", "0.65"]


def main(argv=None) -> int:
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
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.methods is None:
        composites = [*COMPOSITE_METHODS, "sparsegpt", "whisper"]
        args.methods = composites if args.composites else list(MAIN_METHODS)
        args.methods = GAMMA_AUTO if args.gamma_auto else args.methods
    if args.sparsities is None:
        args.sparsities = GAMMA_AUTO_SPARSITIES if args.gamma_auto else ["2:4"]
    quiet_logs()

    if args.eval_windows is not None and len(args.eval_windows) not in (1, len(args.models)):
        parser.error(f"--eval-windows takes 1 or {len(args.models)} values (one per model), "
                     f"not {len(args.eval_windows)}")  # fmt: skip
    sparsities = list(dict.fromkeys(args.sparsities + (SWEEP if args.sweep else [])))
    specs = model_specs()
    results = {"config": vars(args) | {"out": str(args.out), "cache": str(args.cache)},
               "models": {}}  # fmt: skip
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}

    def save_partial():
        write_json(args.out / "quality.json", results)
        if args.cache:
            write_json(args.cache, cache)

    for index, model_name in enumerate(args.models):
        spec = specs[model_name]
        if args.paper_protocol:
            spec = type(spec)(**(vars(spec) | {
                "calibration": "wikitext2", "evaluation": "wikitext2",
                "num_sequences": 128, "seq_len": 4096, "eval_seq_len": 4096,
                "eval_windows": None,
            }))  # fmt: skip
        spec = type(spec)(**(vars(spec) | {  # what this run really uses, as recorded
            "num_sequences": args.num_sequences or spec.num_sequences,
            "seq_len": args.seq_len or spec.seq_len,
        }))  # fmt: skip
        windows = spec.eval_windows
        if args.eval_windows is not None:
            windows = args.eval_windows[index if len(args.eval_windows) > 1 else 0] or None
        dense_key = run_key(spec, windows, [], None)  # the dense model's run
        tokenizer = eval_ids = None
        if not (args.cached_only and dense_key in cache):
            model, tokenizer = load(spec)
            eval_ids = evaluation_ids(spec, tokenizer)
            if dense_key not in cache:  # a resumed benchmark does not evaluate it again
                cache[dense_key] = {"perplexity": spec_perplexity(
                    on_evaluation_device(model), spec, tokenizer, eval_ids, windows)}  # fmt: skip
            del model
        dense = cache[dense_key]["perplexity"]
        print(f"[{model_name}] dense perplexity {dense:.3f}", flush=True)
        entry = results["models"][model_name] = {
            "spec": vars(spec) | {"eval_windows": windows},
            "dense": dense,
            "runs": {},
        }
        run_variants(
            spec, tokenizer, eval_ids, windows, args.methods, sparsities, args.seeds,
            args.num_sequences, args.seq_len, table=entry["runs"],
            on_cell=save_partial, cache=cache, cached_only=args.cached_only,
        )  # fmt: skip
    write_json(args.out / "quality.json", results)
    (args.out / "quality.md").write_text(markdown(results))
    plot(results, args.out)
    plot_gamma_per_layer(results, args.out)
    plot_baseline_ratios(results, args.out)
    print(markdown(results))
    return 0


def baseline_comparisons(entry) -> list[dict]:
    """Each ``gamma: auto`` variant against its baseline (``methods.BASELINE_OF``; gamma 1
    is the baseline) and against the same method at its fixed default gamma, per
    sparsity: perplexity ratios, the tolerance ``max(s.e.m., 1 %)`` of issue 14, and the
    pruning-time ratio."""
    from whisper_modifiers.methods import BASELINE_OF

    rows = []
    for label, cells in entry["runs"].items():
        for variant, cell in cells.items():
            method, _, options = variant.partition(":")
            if "gamma=auto" not in options:
                continue
            baseline = cells.get(BASELINE_OF.get(method, ""))
            fixed = cells.get(method)
            if baseline is None:
                continue
            sems = [x for x in (cell["perplexity_sem"], baseline["perplexity_sem"])
                    if not math.isnan(x)]  # one seed: no s.e.m.  # fmt: skip
            tolerance = max([*sems, 0.01 * baseline["perplexity"]])
            baseline_by_seed = {run["seed"]: run["perplexity"] for run in baseline["runs"]}
            seed_ratios = {run["seed"]: run["perplexity"] / baseline_by_seed[run["seed"]]
                           for run in cell["runs"] if run["seed"] in baseline_by_seed}  # fmt: skip
            threads = {run.get("threads") for run in cell["runs"] + baseline["runs"]}
            rows.append({
                "sparsity": label, "variant": variant, "baseline": BASELINE_OF[method],
                "ratio_to_baseline": cell["perplexity"] / baseline["perplexity"],
                "seed_ratios": seed_ratios,
                "worst_seed_ratio": max(seed_ratios.values()),
                "threads": sorted(threads, key=lambda count: (count is None, count)),
                "never_worse": cell["perplexity"] <= baseline["perplexity"] + tolerance,
                "ratio_to_fixed": fixed and cell["perplexity"] / fixed["perplexity"],
                "time_ratio_to_fixed": fixed and cell["seconds"] / fixed["seconds"],
            })  # fmt: skip
    return rows


def markdown(results) -> str:
    lines = [
        "# Quality benchmark",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/quality.py` "
        f"({results['config']['seeds']} seeds; perplexity mean ± standard error; "
        "pruning time is the mean wall time of `oneshot`).",
    ]
    for model_name, entry in results["models"].items():
        spec = entry["spec"]
        labels = list(entry["runs"])
        methods = list(dict.fromkeys(m for label in labels for m in entry["runs"][label]))
        lines += [
            "",
            f"## {model_name}",
            "",
            f"Calibration {spec['num_sequences']} × {spec['seq_len']} tokens from "
            f"`{Path(spec['calibration']).name}`; evaluation on `{Path(spec['evaluation']).name}`"
            f", {spec['eval_seq_len']}-token windows"
            + (f" (first {spec['eval_windows']})" if spec["eval_windows"] else "")
            + f". Dense perplexity {entry['dense']:.3f}.",
            "",
            "| method | " + " | ".join(f"{label} ppl | {label} time" for label in labels) + " |",
            "|---|" + "---|---|" * len(labels),
        ]
        for method in methods:
            cells = []
            for label in labels:
                r = entry["runs"][label].get(method)
                cells += (
                    [f"{r['perplexity']:.2f} ± {r['perplexity_sem']:.2f}", f"{r['seconds']:.1f} s"]
                    if r
                    else ["", ""]
                )
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        comparisons = baseline_comparisons(entry)
        if comparisons:
            lines += [
                "",
                "`gamma: auto` against its baseline (never worse: perplexity within "
                "max(s.e.m., 1 %) of the baseline's) and against the same method at its "
                "fixed default gamma:",
                "",
                "| sparsity | variant | baseline | ppl / baseline | never worse | "
                "ppl / fixed gamma | time / fixed gamma |",
                "|---|---|---|---|---|---|---|",
            ]
            for row in comparisons:
                fixed = row["ratio_to_fixed"]
                lines.append(
                    f"| {row['sparsity']} | {row['variant']} | {row['baseline']} | "
                    f"{row['ratio_to_baseline']:.3f} | {'yes' if row['never_worse'] else 'NO'} | "
                    + (f"{fixed:.3f} | {row['time_ratio_to_fixed']:.2f}× |" if fixed else "| |")
                )
            lines += seed_ratio_table(comparisons)
    return "\n".join(lines) + "\n"


def seed_ratio_table(comparisons) -> list[str]:
    """Markdown lines: each seed's perplexity over the baseline's on the same seed (same
    calibration windows), the mean of those ratios and the worst one."""
    seeds = sorted({seed for row in comparisons for seed in row["seed_ratios"]})
    lines = [
        "",
        "Per seed, perplexity over the baseline's on the same seed (the same calibration "
        "windows), their mean, the worst seed, and the CPU thread counts of the runs "
        "compared (? where not recorded):",
        "",
        "| sparsity | variant | " + " | ".join(f"seed {seed}" for seed in seeds)
        + " | mean | worst | threads |",
        "|---|---|" + "---|" * (len(seeds) + 3),
    ]  # fmt: skip
    for row in comparisons:
        ratios = row["seed_ratios"]
        cells = [f"{ratios[seed]:.3f}" if seed in ratios else "" for seed in seeds]
        mean = sum(ratios.values()) / len(ratios)
        threads = ", ".join("?" if count is None else str(count) for count in row["threads"])
        worst = row["worst_seed_ratio"]
        lines.append(f"| {row['sparsity']} | {row['variant']} | " + " | ".join(cells)
                     + f" | {mean:.3f} | **{worst:.3f}** | {threads} |")  # fmt: skip
    return lines


def plot(results, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    methods = [m for entry in models.values() for cells in entry["runs"].values() for m in cells]
    colors = {method: f"C{i % 10}" for i, method in enumerate(dict.fromkeys(methods))}
    if any(":" not in label for entry in models.values() for label in entry["runs"]):
        plot_sparsity_sweep(models, colors, out, plt)

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (model_name, entry) in zip(axes[0], models.items(), strict=True):
        label = "2:4" if "2:4" in entry["runs"] else next(iter(entry["runs"]))
        points = sorted((r["seconds"], r["perplexity"], r["perplexity_sem"], method)
                        for method, r in entry["runs"][label].items())  # fmt: skip
        for seconds, ppl, sem, method in points:
            ax.errorbar([seconds], [ppl], yerr=[sem], marker="o", capsize=3, label=method,
                        color=colors[method])  # fmt: skip
        front, best = [], float("inf")
        for seconds, ppl, _, _ in points:  # Pareto front: faster or better than all before
            if ppl < best:
                front.append((seconds, ppl))
                best = ppl
        ax.step(*zip(*front, strict=True), where="post", color="black", linewidth=1,
                label="Pareto front")  # fmt: skip
        ax.set(title=f"{model_name}: perplexity vs pruning time ({label})",
               xlabel="pruning time (s)", ylabel="perplexity", yscale="log")  # fmt: skip
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "perplexity_vs_time.png", dpi=120)
    plt.close(fig)


def plot_sparsity_sweep(models, colors, out: Path, plt) -> None:
    """Perplexity against unstructured sparsity, a line per method (paper Figure 1)."""
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (model_name, entry) in zip(axes[0], models.items(), strict=True):
        labels = [label for label in entry["runs"] if ":" not in label]
        methods = list(dict.fromkeys(m for label in labels for m in entry["runs"][label]))
        for method in methods:
            xs = [float(label) for label in labels if method in entry["runs"][label]]
            rs = [
                entry["runs"][label][method] for label in labels if method in entry["runs"][label]
            ]
            ax.errorbar(xs, [r["perplexity"] for r in rs], yerr=[r["perplexity_sem"] for r in rs],
                        marker="o", capsize=3, label=method, color=colors[method])  # fmt: skip
        ax.axhline(entry["dense"], color="gray", linestyle=":", label="dense")
        ax.set(title=f"{model_name}: perplexity vs unstructured sparsity", xlabel="sparsity",
               ylabel="perplexity", yscale="log")  # fmt: skip
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "perplexity_vs_sparsity.png", dpi=120)
    plt.close(fig)


def plot_baseline_ratios(results, out: Path) -> None:
    """``gamma_auto_ratios.png``: perplexity over the baseline's for each method at its
    fixed default gamma and with ``gamma: auto``'s defaults, a bar per variant and
    sparsity (error bar: the variant's s.e.m. over the baseline), a panel per model."""
    from whisper_modifiers.methods import BASELINE_OF

    panels = []
    for model_name, entry in results["models"].items():
        bars = []
        for label, cells in entry["runs"].items():
            for variant, cell in cells.items():
                method, _, options = variant.partition(":")
                baseline = cells.get(BASELINE_OF.get(method, ""))
                if baseline is None or options not in ("", "gamma=auto"):
                    continue
                scale = baseline["perplexity"]
                bars.append((f"{variant}\n{label}", cell["perplexity"] / scale,
                             cell["perplexity_sem"] / scale, options == "gamma=auto"))  # fmt: skip
        if bars:
            panels.append((model_name, bars))
    if not panels:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(1.1 * max(len(b) for _, b in panels) + 2,
                             4), squeeze=False)  # fmt: skip
    for ax, (model_name, bars) in zip(axes[0], panels, strict=True):
        names, ratios, errors, auto = zip(*bars, strict=True)
        ax.bar(range(len(bars)), ratios, yerr=errors, capsize=3,
               color=["C2" if a else "C7" for a in auto])  # fmt: skip
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(range(len(bars)), names, rotation=60, ha="right", fontsize=7)
        ax.set(title=f"{model_name}: perplexity / baseline (green: gamma auto)",
               ylabel="ppl / SparseGPT or Wanda", ylim=(min(0.9, min(ratios) - 0.05),
                                                       max(ratios) + 0.05))  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "gamma_auto_ratios.png", dpi=120)
    plt.close(fig)


def plot_gamma_per_layer(results, out: Path) -> None:
    """The gamma ``auto`` chose per layer (gate and up share one), a panel per model and
    sparsity, a line per variant with ``gamma: auto``'s defaults (mean over seeds, each
    seed a dot; the ablations' choices are in ``quality.json``)."""
    import re

    panels = [(model_name, label, cells) for model_name, entry in results["models"].items()
              for label, cells in entry["runs"].items()
              if any(r.get("gamma") for cell in cells.values() for r in cell["runs"])]  # fmt: skip
    if not panels:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (model_name, label, cells) in zip(axes[0], panels, strict=True):
        for index, (variant, cell) in enumerate(cells.items()):
            if variant.partition(":")[2] != "gamma=auto":
                continue
            per_layer = {}
            for run in cell["runs"]:
                for name, gamma in (run.get("gamma") or {}).items():
                    if name.endswith("gate_proj"):
                        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
                        per_layer.setdefault(layer, []).append(gamma)
            if not per_layer:
                continue
            layers = sorted(per_layer)
            color = f"C{index % 10}"
            ax.plot(layers, [sum(per_layer[i]) / len(per_layer[i]) for i in layers],
                    color=color, label=variant)  # fmt: skip
            for i in layers:
                ax.scatter([i] * len(per_layer[i]), per_layer[i], color=color, s=10, alpha=0.5)
        ax.set(title=f"{model_name} {label}: chosen gamma per layer", xlabel="layer",
               ylabel="gamma (gate/up)", yscale="symlog", ylim=(-0.001, 1.1))  # fmt: skip
        ax.set_yscale("symlog", linthresh=0.01)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "gamma_per_layer.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
