"""``whisper-diagnose``: the diagnostics of one layer, as JSON and PNG figures.

whisper-diagnose                                   # embedded SmolLM2, a middle gate_proj
whisper-diagnose --model DIR --module model.layers.3.mlp.up_proj --out diagnostics/
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from whisper_modifiers.checkpoint import strict_json
from whisper_modifiers.output_dir import OutputDirError, check_output_dir, partial_output
from whisper_modifiers.preflight import (
    UsageError,
    calibration_sequences,
    check_minimum,
    linear_names,
    meta_model,
    model_config,
    read_text,
    summarize_names,
)

REPORT = "diagnostics.json"  # marks an --out that whisper-diagnose wrote
DEFAULT_SPARSITIES = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
DEFAULT_GAMMAS = [0.0, 0.001, 0.01, 0.1, 0.3, 1.0]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="whisper-diagnose", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="hub id or local dir (default: embedded)")
    parser.add_argument(
        "--module", default=None, help="Linear module (default: the middle layer's gate_proj)"
    )
    parser.add_argument("--calibration", default="embedded")
    parser.add_argument("--num-sequences", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sparsities", type=float, nargs="+", default=DEFAULT_SPARSITIES)
    parser.add_argument("--gammas", type=float, nargs="+", default=DEFAULT_GAMMAS)
    parser.add_argument("--out", type=Path, default=Path("diagnostics"))
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier whisper-diagnose --out"
    )
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except UsageError as error:
        parser.error(str(error))  # "whisper-diagnose: error: ...", exit code 2
    return args


def check_args(args) -> None:
    """The numeric flags (before any work)."""
    check_minimum("--num-sequences", args.num_sequences, 1)
    check_minimum("--seq-len", args.seq_len, 2, "pairs are formed within a sequence")
    check_minimum("--seed", args.seed, 0)
    for value in args.sparsities:
        if not 0 <= value < 1:
            raise UsageError(f"--sparsities must lie in [0, 1); got {value}")
    for value in args.gammas:
        if not 0 <= value <= 1:
            raise UsageError(f"--gammas must lie in [0, 1]; got {value}")


def resolve_module(config, name: str | None) -> str:
    """``name`` (default: the middle layer's gate_proj), checked to be a Linear of the
    model (on a meta-device model: no weights loaded)."""
    skeleton = meta_model(config)
    if name is None:
        name = f"model.layers.{config.num_hidden_layers // 2}.mlp.gate_proj"
    valid = linear_names(skeleton)
    if name not in valid:
        found = dict(skeleton.named_modules()).get(name)
        what = "no module" if found is None else f"a {type(found).__name__}, not a Linear"
        raise UsageError(
            f"--module {name!r} is {what}; the Linear modules are: {summarize_names(valid)}"
        )
    return name


def check_inputs(args) -> tuple[str, str, Path, str]:
    """Before any work: the model, the module's full name, the output directory (the rules
    of whisper-prune's --output-dir) and the calibration text; a bad one raises
    ``UsageError`` naming its flag."""
    from whisper_modifiers.data import load_corpus
    from whisper_modifiers.models import resolve_model

    try:
        model_id = resolve_model(args.model)
    except FileNotFoundError as error:
        raise UsageError(f"--model: {error}") from error
    name = resolve_module(model_config(model_id), args.module)
    inputs_on_disk = [p for p in (model_id, args.calibration) if Path(p).exists()]
    try:
        out = check_output_dir(
            args.out,
            inputs_on_disk,
            args.overwrite,
            flag="--out",
            marker=REPORT,
            program="whisper-diagnose",
            output=f"{REPORT} of an earlier whisper-diagnose",
        )
    except OutputDirError as error:
        raise UsageError(str(error)) from error
    text = read_text("--calibration", args.calibration, lambda s: load_corpus(s, "train"))
    return model_id, name, out, text


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from whisper_modifiers import diagnostics as d
    from whisper_modifiers.statistics import mapping_difficulty

    model_id, name, out, text = check_inputs(args)
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    sequences = calibration_sequences(
        tokenizer, text, args.calibration, args.num_sequences, args.seq_len, args.seed
    )
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32).eval()
    module = model.get_submodule(name)
    inputs = d.capture_inputs(model, name, sequences)
    pairs = d.sequence_pairs(inputs, args.seed, name)
    weight = module.weight.detach().float()

    outputs = torch.cat(inputs) @ weight.t()
    wasserstein = d.wasserstein_to_normal(outputs.t())
    neurons = d.wasserstein_neurons(wasserstein)
    difficulty = mapping_difficulty(weight, torch.cat(pairs))
    scores = d.saliencies(weight, inputs, pairs)
    preserved = d.difficulty_under_pruning(weight, inputs, pairs, args.sparsities, neurons=neurons)
    sweep = d.gamma_sweep(weight, inputs, pairs, args.gammas)

    report = {
        "model": model_id,
        "module": name,
        "calibration": {
            "source": args.calibration,
            "num_sequences": args.num_sequences,
            "seq_len": args.seq_len,
            "seed": args.seed,
        },
        "wasserstein_neurons": neurons.tolist(),
        "mapping_difficulty": difficulty.tolist(),
        "wasserstein_distance": wasserstein.tolist(),
        "correlation_difficulty_wasserstein": float(
            torch.corrcoef(torch.stack([difficulty, wasserstein]))[0, 1]
        ),
        "difficulty_preserved": {"sparsities": args.sparsities, **preserved},
        "gamma_sweep": sweep,
    }
    with partial_output(out) as partial:  # never a half-written --out
        _plot(partial, scores, neurons, preserved, args.sparsities, sweep, name)
        (partial / REPORT).write_text(strict_json(report))
    return report


def _plot(out, scores, neurons, preserved, sparsities, sweep, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    generator = torch.Generator().manual_seed(0)
    wanda = scores["wanda"].reshape(-1)
    sample = torch.randperm(wanda.numel(), generator=generator)[:20000]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, method in zip(axes, ("wisp", "wisp_plus"), strict=True):
        ax.scatter(wanda[sample], scores[method].reshape(-1)[sample], s=1, alpha=0.3)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="Wanda saliency",
            ylabel=f"{method} saliency",
            title=f"{method} vs Wanda ({name})",
        )
    fig.tight_layout()
    fig.savefig(out / "saliency_scatter.png", dpi=110)
    plt.close(fig)

    random = torch.randperm(scores["wanda"].shape[0], generator=generator)[: len(neurons)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (method, matrix) in zip(axes, scores.items(), strict=True):
        normalised = (matrix / matrix.mean()).clamp_min(1e-12).log10()
        ax.hist(
            normalised[random].reshape(-1), bins=60, alpha=0.6, density=True, label="random neurons"
        )
        ax.hist(
            normalised[neurons].reshape(-1),
            bins=60,
            alpha=0.6,
            density=True,
            label="Wasserstein neurons (top 1%)",
        )
        ax.set(title=method, xlabel="log10 saliency / layer mean")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "saliency_distributions.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for method, values in preserved.items():
        ax.plot(sparsities, values, marker="o", label=method)
    ax.set(
        xlabel="sparsity (this layer alone)",
        ylabel="mapping difficulty kept (pruned/dense)",
        title="Wasserstein neurons' mapping difficulty under pruning",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "difficulty_vs_sparsity.png", dpi=110)
    plt.close(fig)

    gammas = [row["gamma"] for row in sweep]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(
        axes,
        ("mse_differences", "mse_outputs", "r2_means"),
        ("relative MSE of W dX", "relative MSE of W X", "R² of neuronwise output means"),
        strict=True,
    ):
        ax.plot([max(g, 1e-4) for g in gammas], [row[key] for row in sweep], marker="o")
        ax.set(xscale="log", xlabel="gamma (0 plotted at 1e-4)", ylabel=label)
    fig.tight_layout()
    fig.savefig(out / "gamma_sweep.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        report = run(parse_args(argv))
    except UsageError as error:
        print(f"whisper-diagnose: error: {error}", file=sys.stderr)
        return 2
    print(f"{report['module']}: Wasserstein neurons {report['wasserstein_neurons']}")
    print(
        f"correlation(mapping difficulty, Wasserstein distance) = "
        f"{report['correlation_difficulty_wasserstein']:.3f}"
    )
    for row in report["gamma_sweep"]:
        print(
            f"gamma {row['gamma']:<6} MSE(WX) {row['mse_outputs']:.4f}  "
            f"MSE(WdX) {row['mse_differences']:.4f}  R2(means) {row['r2_means']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
