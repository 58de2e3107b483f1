"""Speed benchmark: pruning wall time and peak memory of each method against its
baseline, measured in one run on the same model and calibration set.

    python benchmarks/speed.py                      # SmolLM2-135M, 32 x 512 tokens, 3 reps
    python benchmarks/speed.py --models stories260K --repeats 5
    python benchmarks/speed.py --pairs centered --out benchmarks/results/centered
    python benchmarks/speed.py --pairs auto --out benchmarks/results/gamma_auto   # gamma: auto
    python benchmarks/speed.py --pairs auto --only whisper:gamma=auto --repeats 2
    python benchmarks/speed.py --pairs pipeline --out benchmarks/results/pipeline
    python benchmarks/speed.py --random-layers 2 --num-sequences 128 --seq-len 4096 \
        --offload-devices cuda cpu --batch-sizes 1 4     # Llama-2-7B-shaped, random weights

``--batch-effect`` prunes ``--models`` (default SmolLM2-135M) with each of ``--methods``
at each of ``--batch-sizes`` and reports the time and the mask agreement against batch 1
(``speed_batch.md`` / ``.json``).

``--random-layers L`` measures a Llama-2-7B-shaped decoder of ``L`` layers with random
weights (bfloat16 where CUDA is, else float32; ``--hidden``/``--intermediate`` shrink it
for a smoke run) on random tokens, for each method × ``--pipelines`` (llmcompressor's
``sequential`` and our ``whisper_layerwise``) × activation-cache device × batch size, and
reports seconds per layer against issue #13's per-layer targets (the paper's H100 times
per Llama-2-7B layer); ``--reference`` adds the reference procedure (Wanda and SparseGPT
as their repositories run them) and each row's ratio to it, ``--profile METHOD`` a profile
of one method (``speed_random``). Writes ``speed_random.md`` and ``speed_random.json``.

Every measurement runs in a fresh process (so peak memory is not hidden by memory the
allocator kept from an earlier run); baseline and method alternate, and the ratio of the
medians is reported. Targets (issue #3): Wisp <= 1.02x Wanda, Wisp+ <= 1.5x Wanda,
Whisper <= 1.03x SparseGPT in time, and peak memory <= 1.1x the baseline. The centered
variants (issue #6) are held to the same targets as their random-pair parents: they
are derived from the sums the baseline keeps plus per-sequence means. ``--pairs auto``
holds ``gamma: auto`` to issue 14's <= 1.5x the same method at a fixed gamma (its memory
is reported against the same 1.1x, which it is not designed to meet: it keeps the
held-out sequences' inputs and a copy of the layer's difference statistics).
``--pairs pipeline`` times each main method under ``whisper_layerwise`` against the same
method under oneshot's default pipeline (issue 24: no slower, ratio <= 1).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    calibration_set,
    load,
    model_specs,
    prune,
    quiet_logs,
    write_json,
)
from speed_random import LAYER_TARGETS, main_random  # noqa: E402
from variant_runs import parse_variant  # noqa: E402

from whisper_modifiers.modifiers import PIPELINE_NAME as PIPELINE  # noqa: E402

# (baseline, method or "method:option=value" variant, time target); "variant@pipeline"
# runs oneshot with that calibration pipeline
PAIRS = {
    "main": [("wanda", "wisp", 1.02), ("wanda", "wisp_plus", 1.5), ("sparsegpt", "whisper", 1.03)],
    "centered": [
        ("wanda", "wisp:pairing=centered", 1.02),
        ("sparsegpt", "whisper:pairing=centered", 1.03),
    ],
    # The composites have no target of their own; they are held to their parents' targets.
    "composites": [
        ("ria", "ria_wisp", 1.02),
        ("ria", "ria_wisp_plus", 1.5),
        ("alps", "alps_whisper", 1.03),
        ("sparsegpt", "alps", float("inf")),
    ],  # ALPS's cost against SparseGPT
    # gamma: auto's cost against the same method at a fixed gamma (issue 14: <= 1.5x)
    "auto": [
        ("whisper", "whisper:gamma=auto", 1.5),
        ("wisp", "wisp:gamma=auto", 1.5),
        ("wisp_plus", "wisp_plus:gamma=auto", 1.5),
    ],
    # issue 24: our layer-by-layer pipeline against llmcompressor's default (no slower)
    "pipeline": [
        (m, f"{m}@{PIPELINE}", 1.0) for m in ("wanda", "wisp", "wisp_plus", "sparsegpt", "whisper")
    ],
}
MEMORY_TARGET = 1.1


def measure(model_name, variant, structure, num_sequences, seq_len, queue):
    quiet_logs()
    from whisper_modifiers.methods import build_recipe

    spec = model_specs()[model_name]
    model, tokenizer = load(spec)
    dataset = calibration_set(spec, tokenizer, 0, num_sequences, seq_len)
    variant, _, pipeline = variant.partition("@")
    method, options = parse_variant(variant)
    recipe = build_recipe(method, 0.5, structure, 0, **options)
    seconds, peak = prune(
        model, tokenizer, dataset, recipe, **({"pipeline": pipeline} if pipeline else {})
    )
    queue.put((seconds, peak, weights_digest(model)))


def weights_digest(model) -> str:
    """SHA-256 of the model's Linear weights, in module order: equal digests, equal bits."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            digest.update(module.weight.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def run_one(model_name, variant, args) -> tuple[float, int, str]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(
        target=measure,
        args=(model_name, variant, args.structure, args.num_sequences, args.seq_len, queue),
    )
    process.start()
    result = queue.get()
    process.join()
    if process.exitcode:
        raise RuntimeError(f"{variant} failed with exit code {process.exitcode}")
    return result


def main_batch_effect(args) -> int:
    """Time and masks at each batch size against batch 1, on real models."""
    import torch

    from whisper_modifiers.methods import build_recipe, run_oneshot

    rows = []
    for model_name in args.models:
        spec = model_specs()[model_name]
        for method in args.methods:
            masks = {}
            for batch_size in args.batch_sizes:
                model, tokenizer = load(spec)
                dataset = calibration_set(spec, tokenizer, 0, args.num_sequences, args.seq_len)
                recipe = build_recipe(method, 0.5, args.structure, 0)
                start = time.perf_counter()
                run_oneshot(model, tokenizer, dataset, recipe, batch_size=batch_size)
                seconds = time.perf_counter() - start
                masks[batch_size] = {
                    n: m.weight.detach() != 0
                    for n, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear)
                }
                first = masks[args.batch_sizes[0]]
                same = sum((first[n] == masks[batch_size][n]).sum().item() for n in first)
                total = sum(v.numel() for v in first.values())
                rows.append(
                    {
                        "model": model_name,
                        "method": method,
                        "batch_size": batch_size,
                        "seconds": seconds,
                        "mask_agreement": same / total,
                    }
                )
                print(
                    f"{model_name} {method:<10} batch {batch_size}: {seconds:6.1f} s, masks "
                    f"agree with batch {args.batch_sizes[0]} on {same / total:.5%}",
                    flush=True,
                )
    lines = [
        "# Calibration batch size: time and masks",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/speed.py --batch-effect` on CPU"
        f": {args.num_sequences} × {args.seq_len} calibration tokens, mask {args.structure}, "
        f"one run each; agreement is against batch {args.batch_sizes[0]}.",
        "",
        "| model | method | batch | time (s) | mask agreement |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['method']} | {r['batch_size']} | {r['seconds']:.1f} | "
        f"{r['mask_agreement']:.5%} |"
        for r in rows
    ]
    write_json(
        args.out / "speed_batch.json", {"config": vars(args) | {"out": str(args.out)}, "rows": rows}
    )
    (args.out / "speed_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--structure", default="2:4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", nargs="+", default=["main", "centered"], choices=list(PAIRS))
    parser.add_argument("--composites", action="store_true", help="add the RIA and ALPS pairs")
    parser.add_argument(
        "--only", nargs="+", help="only the pairs of these variants (e.g. whisper:gamma=auto)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--random-layers",
        type=int,
        default=0,
        help="measure a Llama-2-7B-shaped random model of this many layers",
    )
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["wanda", "wisp", "wisp_plus", "sparsegpt", "whisper"],
        choices=list(LAYER_TARGETS),
    )
    parser.add_argument("--offload-devices", nargs="+", default=["cuda"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    parser.add_argument(
        "--pipelines",
        nargs="+",
        default=["sequential", PIPELINE],
        help="calibration pipelines --random-layers compares",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="--random-layers: time the reference procedure first, same model",
    )
    parser.add_argument(
        "--reference-methods",
        nargs="+",
        default=["wanda", "sparsegpt"],
        choices=["wanda", "sparsegpt"],
    )
    parser.add_argument(
        "--profile",
        default=None,
        choices=list(LAYER_TARGETS),
        help="--random-layers: profile one more run of this method",
    )
    parser.add_argument(
        "--batch-effect",
        action="store_true",
        help="time and masks at each --batch-sizes against the first",
    )
    return parser.parse_args(argv)


def time_pairs(model_name: str, pairs, args) -> tuple[dict, dict, dict]:
    """Every method of ``pairs`` on ``model_name``, ``args.repeats`` times, each in a fresh
    process, the order reversed every other round: per method its seconds, peak extra bytes
    and the set of its runs' ``weights_digest``."""
    times: dict[str, list[float]] = {}
    peaks: dict[str, list[int]] = {}
    digests: dict[str, set[str]] = {}
    for rep in range(args.repeats):
        order = [m for pair in pairs for m in pair[:2]]
        order = list(dict.fromkeys(order if rep % 2 == 0 else order[::-1]))
        for method in order:
            seconds, peak, digest = run_one(model_name, method, args)
            times.setdefault(method, []).append(seconds)
            peaks.setdefault(method, []).append(peak)
            digests.setdefault(method, set()).add(digest)
            print(
                f"[{model_name}] rep {rep} {method:<24} {seconds:7.2f} s  "
                f"peak +{peak / 2**20:7.1f} MiB",
                flush=True,
            )
    return times, peaks, digests


def pair_rows(pairs, times: dict, peaks: dict, digests: dict) -> list[dict]:
    """Per (baseline, method, target) pair: the medians, their ratios and targets, and
    whether every run of both gave the same weights."""
    rows = []
    for baseline, method, target in pairs:
        t_ratio = statistics.median(times[method]) / statistics.median(times[baseline])
        m_ratio = statistics.median(peaks[method]) / max(statistics.median(peaks[baseline]), 1)
        rows.append(
            {
                "baseline": baseline,
                "method": method,
                "baseline_seconds": statistics.median(times[baseline]),
                "method_seconds": statistics.median(times[method]),
                "time_ratio": t_ratio,
                "time_target": target,
                "baseline_peak_bytes": statistics.median(peaks[baseline]),
                "method_peak_bytes": statistics.median(peaks[method]),
                "memory_ratio": m_ratio,
                "memory_target": MEMORY_TARGET,
                "same_weights": len(digests[method] | digests[baseline]) == 1,
            }
        )
    return rows


def model_markdown(model_name: str, rows: list[dict]) -> list[str]:
    lines = [
        "",
        f"## {model_name}",
        "",
        "| method / baseline | time (s) | time ratio | target | peak extra memory (MiB) "
        "| memory ratio | target | same weights, every run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} / {r['baseline']} | {r['method_seconds']:.2f} / "
            f"{r['baseline_seconds']:.2f} | **{r['time_ratio']:.3f}×** | "
            f"≤ {r['time_target']}× {'✓' if r['time_ratio'] <= r['time_target'] else '✗'} | "
            f"{r['method_peak_bytes'] / 2**20:.0f} / {r['baseline_peak_bytes'] / 2**20:.0f} | "
            f"**{r['memory_ratio']:.3f}×** | ≤ {MEMORY_TARGET}× "
            f"{'✓' if r['memory_ratio'] <= MEMORY_TARGET else '✗'} | "
            f"{'yes' if r['same_weights'] else 'no'} |"
        )
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.batch_effect:
        quiet_logs()
        args.out.mkdir(parents=True, exist_ok=True)
        return main_batch_effect(args)
    if args.random_layers:
        quiet_logs()
        args.out.mkdir(parents=True, exist_ok=True)
        return main_random(args)
    groups = list(dict.fromkeys(args.pairs + (["composites"] if args.composites else [])))
    pairs = [
        pair for group in groups for pair in PAIRS[group] if not args.only or pair[1] in args.only
    ]

    report = {"config": vars(args) | {"out": str(args.out)}, "models": {}}
    lines = [
        "# Speed benchmark",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/speed.py`: "
        f"{args.num_sequences} × {args.seq_len} calibration tokens, mask {args.structure}, "
        f"median of {args.repeats} alternating runs, each in a fresh process.",
    ]
    for model_name in args.models:
        times, peaks, digests = time_pairs(model_name, pairs, args)
        rows = pair_rows(pairs, times, peaks, digests)
        report["models"][model_name] = {"times": times, "peaks": peaks, "ratios": rows}
        lines += model_markdown(model_name, rows)
    write_json(args.out / "speed.json", report)
    (args.out / "speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
