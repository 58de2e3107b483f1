"""Speed benchmark: pruning wall time and peak memory of each method against its
baseline, measured in one run on the same model and calibration set.

    python benchmarks/speed.py                      # SmolLM2-135M, 32 x 512 tokens, 3 reps
    python benchmarks/speed.py --models stories260K --repeats 5
    python benchmarks/speed.py --pairs centered --out benchmarks/results/centered

Every measurement runs in a fresh process (so peak memory is not hidden by memory the
allocator kept from an earlier run); baseline and method alternate, and the ratio of the
medians is reported. Targets (issue #3): Wisp <= 1.02x Wanda, Wisp+ <= 1.5x Wanda,
Whisper <= 1.03x SparseGPT in time, and peak memory <= 1.1x the baseline. The centered
variants (issue #6) are held to the same targets as their random-pair parents: they
are derived from the sums the baseline keeps plus per-sequence means.
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
    parse_variant,
    prune,
    quiet_logs,
    write_json,
)

# (baseline, method or "method:option=value" variant, time target)
PAIRS = {
    "main": [("wanda", "wisp", 1.02), ("wanda", "wisp_plus", 1.5),
             ("sparsegpt", "whisper", 1.03)],
    "centered": [("wanda", "wisp:pairing=centered", 1.02),
                 ("sparsegpt", "whisper:pairing=centered", 1.03)],
    # The composites have no target of their own; they are held to their parents' targets.
    "composites": [("ria", "ria_wisp", 1.02), ("ria", "ria_wisp_plus", 1.5),
                   ("alps", "alps_whisper", 1.03),
                   ("sparsegpt", "alps", float("inf"))],  # ALPS's cost against SparseGPT
}  # fmt: skip
MEMORY_TARGET = 1.1


def measure(model_name, variant, structure, num_sequences, seq_len, queue):
    quiet_logs()
    from whisper_modifiers.methods import build_recipe

    spec = model_specs()[model_name]
    model, tokenizer = load(spec)
    dataset = calibration_set(spec, tokenizer, 0, num_sequences, seq_len)
    method, options = parse_variant(variant)
    recipe = build_recipe(method, 0.5, structure, 0, **options)
    seconds, peak = prune(model, tokenizer, dataset, recipe)
    queue.put((seconds, peak))


def run_one(model_name, variant, args) -> tuple[float, int]:
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--structure", default="2:4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", nargs="+", default=["main", "centered"], choices=list(PAIRS))
    parser.add_argument("--composites", action="store_true", help="add the RIA and ALPS pairs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    groups = list(dict.fromkeys(args.pairs + (["composites"] if args.composites else [])))
    pairs = [pair for group in groups for pair in PAIRS[group]]

    report = {"config": vars(args) | {"out": str(args.out)}, "models": {}}
    lines = [
        "# Speed benchmark",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/speed.py`: "
        f"{args.num_sequences} × {args.seq_len} calibration tokens, mask {args.structure}, "
        f"median of {args.repeats} alternating runs, each in a fresh process.",
    ]
    for model_name in args.models:
        times: dict[str, list[float]] = {}
        peaks: dict[str, list[int]] = {}
        for rep in range(args.repeats):
            order = [m for pair in pairs for m in pair[:2]]
            order = list(dict.fromkeys(order if rep % 2 == 0 else order[::-1]))
            for method in order:
                seconds, peak = run_one(model_name, method, args)
                times.setdefault(method, []).append(seconds)
                peaks.setdefault(method, []).append(peak)
                print(f"[{model_name}] rep {rep} {method:<24} {seconds:7.2f} s  "
                      f"peak +{peak / 2**20:7.1f} MiB", flush=True)  # fmt: skip
        rows = []
        for baseline, method, target in pairs:
            t_ratio = statistics.median(times[method]) / statistics.median(times[baseline])
            m_ratio = statistics.median(peaks[method]) / max(statistics.median(peaks[baseline]), 1)
            rows.append({
                "baseline": baseline, "method": method,
                "baseline_seconds": statistics.median(times[baseline]),
                "method_seconds": statistics.median(times[method]),
                "time_ratio": t_ratio, "time_target": target,
                "baseline_peak_bytes": statistics.median(peaks[baseline]),
                "method_peak_bytes": statistics.median(peaks[method]),
                "memory_ratio": m_ratio, "memory_target": MEMORY_TARGET,
            })  # fmt: skip
        report["models"][model_name] = {"times": times, "peaks": peaks, "ratios": rows}
        lines += [
            "",
            f"## {model_name}",
            "",
            "| method / baseline | time (s) | time ratio | target | peak extra memory (MiB) "
            "| memory ratio | target |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['method']} / {r['baseline']} | {r['method_seconds']:.2f} / "
                f"{r['baseline_seconds']:.2f} | **{r['time_ratio']:.3f}×** | "
                f"≤ {r['time_target']}× {'✓' if r['time_ratio'] <= r['time_target'] else '✗'} | "
                f"{r['method_peak_bytes'] / 2**20:.0f} / {r['baseline_peak_bytes'] / 2**20:.0f} | "
                f"**{r['memory_ratio']:.3f}×** | ≤ {MEMORY_TARGET}× "
                f"{'✓' if r['memory_ratio'] <= MEMORY_TARGET else '✗'} |"
            )
    write_json(args.out / "speed.json", report)
    (args.out / "speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
