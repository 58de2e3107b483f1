"""The CPU op (2:4 and unstructured layers) against torch's dense linear (oneDNN), per
layer shape, in one run.

    python benchmarks/cpu_sparse24.py                      # Llama 7B and 8B shapes, bfloat16
    python benchmarks/cpu_sparse24.py --shapes 7B --tokens 1 16 --dtype float32
    python benchmarks/cpu_sparse24.py --sparsity 2:4 0.5 0.65 0.7 --tokens 1 4 16

For each projection of Llama-2-7B and Llama-3-8B as vLLM runs it (qkv and gate_up fused),
random weights pruned 2:4 by magnitude, at each token count: dense ``F.linear`` on the
dense weight against the op on the compressed tensors (``sparse_serving.cpu.op``: the op
with the measured plan's choice, as served, and each of its paths: row kernels up to
``--rows-up-to`` tokens, the GEMMs where they run (for 2:4 layers the 2:4 GEMM and the
unstructured one over their rows, "lanes"), the tiles). Distinct copies of the
weights are cycled (at least ``--working-set`` MiB of each) so that no call finds its
weight in cache: decode reads every weight from memory, as in a served model. The sides
alternate, one pass each per round, and every time is the median over ``--repeats``
rounds (this machine is shared: a side measured alone would take its noise); ratios are
dense time / op time (above 1: the op is faster). Run with the serving environment's
Python (``.venv-serve/bin/python``), the table also has vLLM's own dense CPU GEMM as the
plugin's dense layers run it (``onednn_mm`` on a weight oneDNN packed once: a stronger
baseline than ``F.linear`` at few tokens) and the op's ratio against it. Writes
``cpu_sparse24-ISA.md``, ``.json`` and ``.png`` to ``--out``, ISA being the op's kernels here
(``avx2``, ``avx512``, ``avx512_bf16``: one file set per kind of CPU), each labelled by this
CPU's line. With ``--sparsity`` other than ``2:4`` alone, each unstructured sparsity is
measured too (random weights keeping ``1 - sparsity`` of their values anywhere, in the
bitmask layout) and ``cpu_sparse-ISA.*`` holds a summary by sparsity, each sparsity's table,
and a plot of speed against sparsity next to the bytes bound. ``--replot JSON`` writes
the table and the plot again from a JSON (the serving environment has no matplotlib).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, check_serving_sparsities, write_json  # noqa: E402

SHAPES = {  # (out, in) of each projection as vLLM runs it
    "7B": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
           "down": (4096, 11008)},
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336)},
}  # fmt: skip
TOKENS = [1, 4, 16, 64, 512]


def cpu_line() -> str:
    import torch

    from whisper_modifiers.sparse_serving.cpu.cpu_info import CPU_FLAGS, cpu_flag_set, cpu_model
    from whisper_modifiers.sparse_serving.cpu.op import cpu_isa

    flags = cpu_flag_set()
    shown = " ".join(flag for flag in (*CPU_FLAGS, "avx512_vbmi2") if flag in flags)
    return (f"{cpu_model()} ({shown}; {torch.get_num_threads()} threads; op kernels "
            f"{cpu_isa()})")  # fmt: skip


def alternating_medians(sides: dict[str, list], repeats: int) -> dict[str, float]:
    """Per side, the median over ``repeats`` rounds of the time per call; each round runs
    one pass of every side (each call with its own weight copy), the sides in turn."""
    for calls in sides.values():  # warm-up: pages touched, kernels built, plans made
        for call in calls:
            call()
    times = {label: [] for label in sides}
    for _ in range(repeats):
        for label, calls in sides.items():
            start = time.perf_counter()
            for call in calls:
                call()
            times[label].append((time.perf_counter() - start) / len(calls))
    return {label: statistics.median(values) for label, values in times.items()}


def vllm_dense_linear():
    """vLLM's dense CPU GEMM for a weight, as its unquantized layers run it (a oneDNN
    handle made once per weight, then ``onednn_mm``), or None without vLLM's CPU ops."""
    try:
        import vllm._custom_ops as ops
    except Exception:  # no vLLM here (the pruning environment)
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None

    def linear_for(weight):
        handle = ops.create_onednn_mm(weight.t(), 32)
        return lambda x: ops.onednn_mm(handle, x, None)

    return linear_for


def op_layers(rows: int, columns: int, dtype, sparsity: str, copies: int):
    """``copies`` random weights of the layout (``2:4``, or unstructured at ``sparsity``),
    their compressed bytes, and ``run(x, tiled_from, gemm_from, lanes_until, brgemm_tiles)``
    of the op on each."""
    from whisper_modifiers.sparse_serving.cpu.op import bitmask_cpu_linear, sparse24_cpu_linear
    from whisper_modifiers.sparse_serving.cpu.plans import random_two_four, random_unstructured
    from whisper_modifiers.sparse_serving.format.bitmask import compress_bitmask
    from whisper_modifiers.sparse_serving.format.two_four import compress_24

    if sparsity == "2:4":
        dense = [random_two_four(rows, columns, dtype, seed=i) for i in range(copies)]
        stored = [compress_24(weight) for weight in dense]
        runs = [lambda x, t, g, lanes, brgemm, c=c, b=b: sparse24_cpu_linear(
            x, c, b, None, columns, t, g, lanes, brgemm) for c, b in stored]  # fmt: skip
        return dense, rows * (columns // 2 * dtype.itemsize + -(-columns // 8)), runs
    density = 1 - float(sparsity)
    dense = [random_unstructured(rows, columns, dtype, density, seed=i) for i in range(copies)]
    stored = [compress_bitmask(weight) for weight in dense]
    runs = [lambda x, t, g, lanes, brgemm, v=v, b=b, o=o: bitmask_cpu_linear(
        x, v, b, o, None, columns, t, g, brgemm) for v, b, o in stored]  # fmt: skip
    values, bitmask, offsets = stored[0]
    size = sum(tensor.numel() * tensor.element_size() for tensor in (values, bitmask, offsets))
    return dense, size, runs


def measure_shape(rows: int, columns: int, tokens: list[int], dtype, args,
                  sparsity: str = "2:4") -> list[dict]:  # fmt: skip
    import torch
    import torch.nn.functional as F

    from whisper_modifiers.sparse_serving.cpu.op import brgemm_kernel, gemm_runs
    from whisper_modifiers.sparse_serving.cpu.plans import PATH_THRESHOLDS, cpu_plan

    dense_bytes = rows * columns * dtype.itemsize
    copies = max(2, -(-args.working_set * 2**20 // dense_bytes))
    dense, op_bytes, runs = op_layers(rows, columns, dtype, sparsity, copies)
    plan = cpu_plan(rows, columns, dtype, None if sparsity == "2:4" else 1 - float(sparsity))
    linear_for = vllm_dense_linear()
    vllm_dense = [linear_for(weight) for weight in dense] if linear_for else []
    paths = {"op": (plan.tiled_from, plan.gemm_from, plan.lanes_until, plan.brgemm_tiles)}
    paths |= PATH_THRESHOLDS
    gemm = gemm_runs(dtype, dtype)
    brgemm = gemm and brgemm_kernel() != "none"  # the micro-kernel's tiles, in bfloat16
    results = []
    with torch.no_grad():
        for count in tokens:
            x = torch.randn(count, columns).to(dtype)
            sides = {"dense": [lambda w=w, x=x: F.linear(x, w) for w in dense]}
            if vllm_dense:
                sides["vllm_dense"] = [lambda f=f, x=x: f(x) for f in vllm_dense]
            for label, (tiled_from, gemm_from, lanes, brgemm_tiles) in paths.items():
                if ((label == "rows" and count > args.rows_up_to)
                        or (label in ("gemm", "lanes") and not gemm)
                        or (label == "lanes" and sparsity != "2:4")
                        or (label == "brgemm" and not brgemm)):  # fmt: skip
                    continue
                sides[label] = [lambda r=r, t=tiled_from, g=gemm_from, lanes=lanes,
                                b=brgemm_tiles, x=x: r(x, t, g, lanes, b)
                                for r in runs]  # fmt: skip
            times = alternating_medians(sides, args.repeats)
            row = {"tokens": count, "seconds": times, "copies": copies,
                   "ratio": times["dense"] / times["op"], "op_path": plan.path(count),
                   "vllm_ratio": times["vllm_dense"] / times["op"] if vllm_dense else None,
                   "op_bytes_ratio": op_bytes / dense_bytes,
                   "op_gib_per_s": op_bytes / times["op"] / 2**30,
                   "dense_gib_per_s": dense_bytes / times["dense"] / 2**30}  # fmt: skip
            print(
                f"  {rows}x{columns} {sparsity} tokens {count}: dense "
                f"{times['dense'] * 1e3:.3f} ms, op {times['op'] * 1e3:.3f} ms "
                f"({row['op_path']}), {row['ratio']:.2f}x",
                flush=True,
            )
            results.append(row)
    return results


def markdown(payload: dict) -> str:
    from whisper_modifiers.sparse_serving.cpu.plans import PATHS  # the op's paths: columns

    vllm = any(row.get("vllm_ratio") for rows in payload["shapes"].values() for row in rows)
    lines = [f"# The 2:4 CPU op against dense `F.linear` ({payload['dtype']})", "",
             f"CPU: {payload['cpu']}", "",
             "Ratio: dense time / op time (above 1: the op is faster); the op as served "
             "(its measured plan picks row kernels, GEMM or tiles; lanes: a 2:4 layer "
             "in the unstructured GEMM, the tokens in the lanes; brgemm: the tiles through "
             "oneDNN's micro-kernel, AMX tiles where the CPU has them). Each time is the "
             "median of rounds that run every side in turn. GiB/s: weight bytes read per "
             "second (compressed for the op); -: not measured (rows above "
             f"{payload['rows_up_to']} tokens; a path where it does not run)."
             + (" vLLM dense: vLLM's own CPU GEMM (`onednn_mm` on a weight oneDNN packed "
                "once), as its dense layers run; the last ratio is against it." if vllm else ""),
             "", "| model | projection | tokens | dense ms | op ms | op path | ratio | "
             + "".join(f"{path} ms | " for path in PATHS) + "dense GiB/s | op GiB/s |"
             + (" vLLM dense ms | ratio to vLLM dense |" if vllm else ""),
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
             + ("---:|---:|" if vllm else "")]  # fmt: skip
    for key, rows in payload["shapes"].items():
        model, projection = key.split("/")
        for row in rows:
            s = row["seconds"]
            path_ms = " | ".join(f"{s[path] * 1e3:.3f}" if path in s else "-"
                                 for path in PATHS)  # fmt: skip
            against_vllm = (f" {s['vllm_dense'] * 1e3:.3f} | **{row['vllm_ratio']:.2f}×** |"
                            if vllm else "")  # fmt: skip
            lines.append(
                f"| {model} | {projection} | {row['tokens']} | {s['dense'] * 1e3:.3f} | "
                f"{s['op'] * 1e3:.3f} | {row['op_path']} | **{row['ratio']:.2f}×** | "
                f"{path_ms} | {row['dense_gib_per_s']:.1f} | {row['op_gib_per_s']:.1f} |"
                + against_vllm
            )
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib here: {path.name} not drawn (--replot its JSON where it is)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for key, rows in payload["shapes"].items():
        tokens = [r["tokens"] for r in rows]
        (line,) = axis.plot(tokens, [r["ratio"] for r in rows], marker="o", label=key)
        if all(r.get("vllm_ratio") for r in rows):  # against vLLM's own dense GEMM: dashed
            axis.plot(tokens, [r["vllm_ratio"] for r in rows], linestyle="--", marker=".",
                      color=line.get_color())  # fmt: skip
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens per call (M)")
    axis.set_ylabel("dense time / 2:4 op time\n(solid: F.linear; dashed: vLLM's oneDNN)")
    axis.set_title(f"2:4 CPU op, {payload['dtype']}\n{payload['cpu']}", fontsize=8)
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def baseline_ratio(row: dict) -> float:
    """The op's ratio against vLLM's dense GEMM where it was timed, else ``F.linear``."""
    return row.get("vllm_ratio") or row["ratio"]


def by_sparsity(payload: dict) -> dict[str, dict[int, list[float]]]:
    """Per sparsity, per token count, every shape's ``baseline_ratio``."""
    table = {}
    for sparsity, entry in payload["sparsities"].items():
        for rows in entry["shapes"].values():
            for row in rows:
                table.setdefault(sparsity, {}).setdefault(row["tokens"], []).append(
                    baseline_ratio(row)
                )
    return table


def baseline_name(payload: dict) -> str:
    """What ``baseline_ratio`` compares with in every row of ``payload``."""
    vllm = all(row.get("vllm_ratio") for entry in payload["sparsities"].values()
               for rows in entry["shapes"].values() for row in rows)  # fmt: skip
    return "vLLM's dense GEMM" if vllm else "dense F.linear"


def bytes_ratio(payload: dict, sparsity: str) -> float:
    """The compressed layout's weight bytes over dense at ``sparsity`` (its first shape's)."""
    return next(iter(payload["sparsities"][sparsity]["shapes"].values()))[0]["op_bytes_ratio"]


def sparsity_markdown(payload: dict) -> str:
    """The speed-against-sparsity summary (median and range over the shapes), then each
    sparsity's own table."""
    table = by_sparsity(payload)
    tokens = sorted({t for cells in table.values() for t in cells})
    against = baseline_name(payload)
    lines = [f"# The CPU op against dense by sparsity ({payload['dtype']})", "",
             f"CPU: {payload['cpu']}", "",
             f"Each cell: dense time / op time against {against}, the median over the shapes "
             "(min–max); the op as served (its measured plan). Weight bytes: the compressed "
             "layout's over dense; bytes bound: their inverse, the most a memory-bound call "
             "can gain.", "",
             "| sparsity | weight bytes | bytes bound | "
             + " | ".join(f"{t} tokens" for t in tokens) + " |",
             "|---|---:|---:|" + "---:|" * len(tokens)]  # fmt: skip
    for sparsity, cells in table.items():
        weight_bytes = bytes_ratio(payload, sparsity)
        ratios = [f"{statistics.median(cells[t]):.2f}× ({min(cells[t]):.2f}–{max(cells[t]):.2f})"
                  if t in cells else "-" for t in tokens]  # fmt: skip
        lines.append(f"| {sparsity} | {weight_bytes:.3f}× | {1 / weight_bytes:.2f}× | "
                     f"{' | '.join(ratios)} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    for sparsity, entry in payload["sparsities"].items():
        sub = payload | {"shapes": entry["shapes"]}
        text += "\n## " + sparsity + "\n\n" + markdown(sub).split("\n", 4)[4]
    return text


def plot_sparsity(payload: dict, path: Path) -> None:
    """Speed against sparsity, one line per token count (the unstructured layouts; 2:4 as
    stars at 50 %), next to the bytes bound."""
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib here: {path.name} not drawn (--replot its JSON where it is)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = by_sparsity(payload)
    unstructured = sorted((float(s), s) for s in table if s != "2:4")
    figure, axis = plt.subplots(figsize=(7, 4.2))
    bound = [1 / bytes_ratio(payload, key) for _, key in unstructured]
    axis.plot([s for s, _ in unstructured], bound, color="black", linestyle="--",
              label="bytes bound")  # fmt: skip
    for tokens in sorted({t for cells in table.values() for t in cells}):
        points = [(s, statistics.median(table[key][tokens])) for s, key in unstructured
                  if tokens in table[key]]  # fmt: skip
        (line,) = axis.plot([s for s, _ in points], [r for _, r in points], marker="o",
                            label=f"{tokens} tokens")  # fmt: skip
        if tokens in table.get("2:4", {}):
            axis.plot([0.5], [statistics.median(table["2:4"][tokens])], marker="*",
                      markersize=11, color=line.get_color(), linestyle="none")  # fmt: skip
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("unstructured sparsity (stars: 2:4)")
    axis.set_ylabel(f"{baseline_name(payload)} time / op time\n(median over shapes)")
    axis.set_title(f"CPU op against dense, {payload['dtype']}\n{payload['cpu']}", fontsize=8)
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_results(stem: Path, payload: dict) -> str:
    """The table and plot of ``payload`` next to its JSON at ``stem``."""
    multi = "sparsities" in payload
    text = sparsity_markdown(payload) if multi else markdown(payload)
    stem.with_suffix(".md").write_text(text)
    (plot_sparsity if multi else plot)(payload, stem.with_suffix(".png"))
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--sparsity",
        nargs="+",
        default=["2:4"],
        help="2:4 and/or unstructured sparsities in (0, 1); more than 2:4 alone writes "
        "cpu_sparse-ISA.* with the speed-against-sparsity plot",
    )
    parser.add_argument(
        "--rows-up-to",
        type=int,
        default=64,
        help="largest token count at which the row kernels alone are timed",
    )
    parser.add_argument(
        "--working-set",
        type=int,
        default=256,
        help="MiB of distinct dense weights cycled per shape (default 256)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_sparse24")
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="write the table and plot of this JSON again, measuring nothing",
    )
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.repeats < 1 or args.working_set < 1:
        parser.error("--tokens, --repeats and --working-set must be at least 1")
    check_serving_sparsities(parser, args.sparsity)
    if args.replot is not None:
        write_results(args.replot.with_suffix(""), json.loads(args.replot.read_text()))
        return 0
    import torch

    from whisper_modifiers.sparse_serving.cpu.op import cpu_isa, cpu_kernels_unavailable

    reason = cpu_kernels_unavailable()
    if reason:
        print(f"the CPU op does not run here: {reason}")
        return 0
    dtype = getattr(torch, args.dtype)
    multi = args.sparsity != ["2:4"]
    stem = args.out / f"{'cpu_sparse' if multi else 'cpu_sparse24'}-{cpu_isa()}"
    payload = {"cpu": cpu_line(), "dtype": args.dtype, "torch": torch.__version__,
               "rows_up_to": args.rows_up_to, "repeats": args.repeats}  # fmt: skip
    if multi:
        payload["sparsities"] = {s: {"shapes": {}} for s in args.sparsity}
    for sparsity in args.sparsity:
        shapes = payload["sparsities"][sparsity]["shapes"] if multi else payload.setdefault(
            "shapes", {})  # fmt: skip
        for model in args.shapes:
            for projection, (rows, columns) in SHAPES[model].items():
                print(f"{model} {projection} {sparsity}", flush=True)
                shapes[f"{model}/{projection}"] = measure_shape(rows, columns, args.tokens,
                                                                dtype, args, sparsity)  # fmt: skip
                write_json(stem.with_suffix(".json"), payload)
    print(write_results(stem, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
