"""The quality benchmark's report (``quality.py`` writes it): the Markdown table, the
comparison of each ``gamma: auto`` variant with its baseline per seed, and the plots
(perplexity against sparsity and against pruning time, the ratios to each baseline, the
chosen gamma per layer)."""

from __future__ import annotations

import math
import time
from pathlib import Path

__all__ = [
    "baseline_comparisons",
    "markdown",
    "plot",
    "plot_baseline_ratios",
    "plot_gamma_per_layer",
]


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
            sems = [
                x for x in (cell["perplexity_sem"], baseline["perplexity_sem"]) if not math.isnan(x)
            ]  # one seed: no s.e.m.
            tolerance = max([*sems, 0.01 * baseline["perplexity"]])
            baseline_by_seed = {run["seed"]: run["perplexity"] for run in baseline["runs"]}
            seed_ratios = {
                run["seed"]: run["perplexity"] / baseline_by_seed[run["seed"]]
                for run in cell["runs"]
                if run["seed"] in baseline_by_seed
            }
            threads = {run.get("threads") for run in cell["runs"] + baseline["runs"]}
            rows.append(
                {
                    "sparsity": label,
                    "variant": variant,
                    "baseline": BASELINE_OF[method],
                    "ratio_to_baseline": cell["perplexity"] / baseline["perplexity"],
                    "seed_ratios": seed_ratios,
                    "worst_seed_ratio": max(seed_ratios.values()),
                    "threads": sorted(threads, key=lambda count: (count is None, count)),
                    "never_worse": cell["perplexity"] <= baseline["perplexity"] + tolerance,
                    "ratio_to_fixed": fixed and cell["perplexity"] / fixed["perplexity"],
                    "time_ratio_to_fixed": fixed and cell["seconds"] / fixed["seconds"],
                }
            )
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
        "| sparsity | variant | "
        + " | ".join(f"seed {seed}" for seed in seeds)
        + " | mean | worst | threads |",
        "|---|---|" + "---|" * (len(seeds) + 3),
    ]
    for row in comparisons:
        ratios = row["seed_ratios"]
        cells = [f"{ratios[seed]:.3f}" if seed in ratios else "" for seed in seeds]
        mean = sum(ratios.values()) / len(ratios)
        threads = ", ".join("?" if count is None else str(count) for count in row["threads"])
        worst = row["worst_seed_ratio"]
        lines.append(
            f"| {row['sparsity']} | {row['variant']} | "
            + " | ".join(cells)
            + f" | {mean:.3f} | **{worst:.3f}** | {threads} |"
        )
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
        points = sorted(
            (r["seconds"], r["perplexity"], r["perplexity_sem"], method)
            for method, r in entry["runs"][label].items()
        )
        for seconds, ppl, sem, method in points:
            ax.errorbar(
                [seconds],
                [ppl],
                yerr=[sem],
                marker="o",
                capsize=3,
                label=method,
                color=colors[method],
            )
        front, best = [], float("inf")
        for seconds, ppl, _, _ in points:  # Pareto front: faster or better than all before
            if ppl < best:
                front.append((seconds, ppl))
                best = ppl
        ax.step(
            *zip(*front, strict=True),
            where="post",
            color="black",
            linewidth=1,
            label="Pareto front",
        )
        ax.set(
            title=f"{model_name}: perplexity vs pruning time ({label})",
            xlabel="pruning time (s)",
            ylabel="perplexity",
            yscale="log",
        )
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
            ax.errorbar(
                xs,
                [r["perplexity"] for r in rs],
                yerr=[r["perplexity_sem"] for r in rs],
                marker="o",
                capsize=3,
                label=method,
                color=colors[method],
            )
        ax.axhline(entry["dense"], color="gray", linestyle=":", label="dense")
        ax.set(
            title=f"{model_name}: perplexity vs unstructured sparsity",
            xlabel="sparsity",
            ylabel="perplexity",
            yscale="log",
        )
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
                bars.append(
                    (
                        f"{variant}\n{label}",
                        cell["perplexity"] / scale,
                        cell["perplexity_sem"] / scale,
                        options == "gamma=auto",
                    )
                )
        if bars:
            panels.append((model_name, bars))
    if not panels:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(panels), figsize=(1.1 * max(len(b) for _, b in panels) + 2, 4), squeeze=False
    )
    for ax, (model_name, bars) in zip(axes[0], panels, strict=True):
        names, ratios, errors, auto = zip(*bars, strict=True)
        ax.bar(
            range(len(bars)),
            ratios,
            yerr=errors,
            capsize=3,
            color=["C2" if a else "C7" for a in auto],
        )
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(range(len(bars)), names, rotation=60, ha="right", fontsize=7)
        ax.set(
            title=f"{model_name}: perplexity / baseline (green: gamma auto)",
            ylabel="ppl / SparseGPT or Wanda",
            ylim=(min(0.9, min(ratios) - 0.05), max(ratios) + 0.05),
        )
    fig.tight_layout()
    fig.savefig(out / "gamma_auto_ratios.png", dpi=120)
    plt.close(fig)


def plot_gamma_per_layer(results, out: Path) -> None:
    """The gamma ``auto`` chose per layer (gate and up share one), a panel per model and
    sparsity, a line per variant with ``gamma: auto``'s defaults (mean over seeds, each
    seed a dot; the ablations' choices are in ``quality.json``)."""
    import re

    panels = [
        (model_name, label, cells)
        for model_name, entry in results["models"].items()
        for label, cells in entry["runs"].items()
        if any(r.get("gamma") for cell in cells.values() for r in cell["runs"])
    ]
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
            ax.plot(
                layers,
                [sum(per_layer[i]) / len(per_layer[i]) for i in layers],
                color=color,
                label=variant,
            )
            for i in layers:
                ax.scatter([i] * len(per_layer[i]), per_layer[i], color=color, s=10, alpha=0.5)
        ax.set(
            title=f"{model_name} {label}: chosen gamma per layer",
            xlabel="layer",
            ylabel="gamma (gate/up)",
            yscale="symlog",
            ylim=(-0.001, 1.1),
        )
        ax.set_yscale("symlog", linthresh=0.01)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "gamma_per_layer.png", dpi=120)
    plt.close(fig)
