"""The 2:4 CPU op against torch's dense linear (oneDNN), per layer shape, in one run.

    python benchmarks/cpu_sparse24.py                      # Llama 7B and 8B shapes, bfloat16
    python benchmarks/cpu_sparse24.py --shapes 7B --tokens 1 16 --dtype float32

For each projection of Llama-2-7B and Llama-3-8B as vLLM runs it (qkv and gate_up fused),
random weights pruned 2:4 by magnitude, at each token count: dense ``F.linear`` on the
dense weight against the op on the compressed tensors (``sparse_serving.cpu_op``: the op
with the measured plan's choice, as served, and each of its paths: row kernels up to
``--rows-up-to`` tokens, the 2:4 GEMM where it runs, the tiles). Distinct copies of the
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
CPU's line; ``--replot JSON`` writes the table and the plot again from a JSON (the serving
environment has no matplotlib).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, write_json  # noqa: E402

SHAPES = {  # (out, in) of each projection as vLLM runs it
    "7B": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
           "down": (4096, 11008)},
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336)},
}  # fmt: skip
TOKENS = [1, 4, 16, 64, 512]


def cpu_line() -> str:
    import torch

    from whisper_modifiers.serving.probe import CPU_FLAGS, cpu_flag_set, cpu_model
    from whisper_modifiers.sparse_serving.cpu_op import cpu_isa

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


def measure_shape(rows: int, columns: int, tokens: list[int], dtype, args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from whisper_modifiers.sparse_serving.cpu_op import NO_TILES, gemm_runs, sparse24_cpu_linear
    from whisper_modifiers.sparse_serving.cpu_plans import cpu_plan, random_two_four
    from whisper_modifiers.sparse_serving.format import compress_24

    dense_bytes = rows * columns * dtype.itemsize
    copies = max(2, -(-args.working_set * 2**20 // dense_bytes))
    dense = [random_two_four(rows, columns, dtype, seed=i) for i in range(copies)]
    compressed = [compress_24(weight) for weight in dense]
    plan = cpu_plan(rows, columns, dtype)
    linear_for = vllm_dense_linear()
    vllm_dense = [linear_for(weight) for weight in dense] if linear_for else []
    paths = {"op": (plan.tiled_from, plan.gemm_from), "rows": (NO_TILES, NO_TILES),
             "gemm": (NO_TILES, 0), "tiles": (0, NO_TILES)}  # fmt: skip
    results = []
    with torch.no_grad():
        for count in tokens:
            x = torch.randn(count, columns).to(dtype)
            sides = {"dense": [lambda w=w, x=x: F.linear(x, w) for w in dense]}
            if vllm_dense:
                sides["vllm_dense"] = [lambda f=f, x=x: f(x) for f in vllm_dense]
            for label, (tiled_from, gemm_from) in paths.items():
                if (label == "rows" and count > args.rows_up_to) or (
                        label == "gemm" and not gemm_runs(dtype, dtype)):  # fmt: skip
                    continue
                sides[label] = [lambda c=c, b=b, t=tiled_from, g=gemm_from, x=x:
                                sparse24_cpu_linear(x, c, b, None, columns, t, g)
                                for c, b in compressed]  # fmt: skip
            times = alternating_medians(sides, args.repeats)
            row = {"tokens": count, "seconds": times, "copies": copies,
                   "ratio": times["dense"] / times["op"], "op_path": plan.path(count),
                   "vllm_ratio": times["vllm_dense"] / times["op"] if vllm_dense else None,
                   "op_gib_per_s": rows * (columns // 2 * dtype.itemsize + -(-columns // 8))
                   / times["op"] / 2**30,
                   "dense_gib_per_s": dense_bytes / times["dense"] / 2**30}  # fmt: skip
            print(
                f"  {rows}x{columns} tokens {count}: dense {times['dense'] * 1e3:.3f} ms, "
                f"op {times['op'] * 1e3:.3f} ms ({row['op_path']}), {row['ratio']:.2f}x",
                flush=True,
            )
            results.append(row)
    return results


def markdown(payload: dict) -> str:
    vllm = any(row.get("vllm_ratio") for rows in payload["shapes"].values() for row in rows)
    lines = [f"# The 2:4 CPU op against dense `F.linear` ({payload['dtype']})", "",
             f"CPU: {payload['cpu']}", "",
             "Ratio: dense time / op time (above 1: the op is faster); the op as served "
             "(its measured plan picks row kernels, 2:4 GEMM or tiles). Each time is the "
             "median of rounds that run every side in turn. GiB/s: weight bytes read per "
             "second (compressed for the op); -: not measured (rows above "
             f"{payload['rows_up_to']} tokens; the GEMM where it does not run)."
             + (" vLLM dense: vLLM's own CPU GEMM (`onednn_mm` on a weight oneDNN packed "
                "once), as its dense layers run; the last ratio is against it." if vllm else ""),
             "", "| model | projection | tokens | dense ms | op ms | op path | ratio | rows ms | "
             "gemm ms | tiles ms | dense GiB/s | op GiB/s |"
             + (" vLLM dense ms | ratio to vLLM dense |" if vllm else ""),
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"
             + ("---:|---:|" if vllm else "")]  # fmt: skip
    for key, rows in payload["shapes"].items():
        model, projection = key.split("/")
        for row in rows:
            s = row["seconds"]
            path_ms = " | ".join(f"{s[path] * 1e3:.3f}" if path in s else "-"
                                 for path in ("rows", "gemm", "tiles"))  # fmt: skip
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
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
    if args.replot is not None:
        payload = json.loads(args.replot.read_text())
        args.replot.with_suffix(".md").write_text(markdown(payload))
        plot(payload, args.replot.with_suffix(".png"))
        return 0
    import torch

    from whisper_modifiers.sparse_serving.cpu_op import cpu_isa, cpu_kernels_unavailable

    reason = cpu_kernels_unavailable()
    if reason:
        print(f"the 2:4 CPU op does not run here: {reason}")
        return 0
    dtype = getattr(torch, args.dtype)
    stem = args.out / f"cpu_sparse24-{cpu_isa()}"
    payload = {
        "cpu": cpu_line(),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "rows_up_to": args.rows_up_to,
        "repeats": args.repeats,
        "shapes": {},
    }
    for model in args.shapes:
        for projection, (rows, columns) in SHAPES[model].items():
            print(f"{model} {projection}", flush=True)
            key = f"{model}/{projection}"
            payload["shapes"][key] = measure_shape(rows, columns, args.tokens, dtype, args)
            write_json(stem.with_suffix(".json"), payload)
    stem.with_suffix(".md").write_text(markdown(payload))
    plot(payload, stem.with_suffix(".png"))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
