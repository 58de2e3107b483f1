"""The sparse CPU op (2:4 and unstructured layers, in their served layouts) against torch's
dense linear (oneDNN), per layer shape, in one run.

    python benchmarks/cpu_sparse_op.py                      # Llama 7B and 8B shapes, bfloat16
    python benchmarks/cpu_sparse_op.py --shapes 7B --tokens 1 16 --dtype float32
    python benchmarks/cpu_sparse_op.py --sparsity 2:4 0.5 0.65 0.7 --tokens 1 4 16
    python benchmarks/cpu_sparse_op.py --dtype int8 --sparsity 2:4 0.65   # W8A8 (cpu_int8_op.py)

For each projection of Llama-2-7B and Llama-3-8B as vLLM runs it (qkv and gate_up fused),
random weights pruned 2:4 by magnitude, at each token count: dense ``F.linear`` on the
dense weight against the op on the compressed tensors (``whisper_sparse.cpu.op``: the op
with the measured plan's choice, as served, and each of its paths: row kernels up to
``--rows-up-to`` tokens, the GEMMs where they run (for 2:4 layers the 2:4 GEMM and the
unstructured one over their rows, "lanes"), the tiles). Distinct copies of the
weights are cycled (at least ``--working-set`` MiB of each) so that no call finds its
weight in cache: decode reads every weight from memory, as in a served model. The sides
alternate, one pass each per round, in orders that give every side every place and every
predecessor alike (``common.balanced_orders``), and every time is the median over ``--repeats``
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
``--isa avx2`` (or ``avx512``) caps the op's kernels below this CPU's and dense alike, as torch
and oneDNN run on such a CPU (``DENSE_CAPS``): a lower kind of CPU, emulated on this one's
memory, in files named ``...-ISA-capped-on-OWN``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, alternated_rounds, check_serving_sparsities, write_json  # noqa: E402
from cpu_layers import (  # noqa: E402
    DENSE_CAPS,
    SHAPES,
    cpu_line,
    op_layers,
    run_all,
    vllm_dense_linear,
)
from cpu_op_tables import write_results  # noqa: E402

TOKENS = [1, 4, 16, 64, 512]
ISAS = ("auto", "avx2", "avx512", "avx512_bf16")  # --isa: "auto" and op.CPU_ISAS


def missing_dense_caps(isa: str) -> dict[str, str]:
    """The environment ``--isa isa`` needs that this process did not start with."""
    return {
        name: value
        for name, value in DENSE_CAPS.get(isa, {}).items()
        if os.environ.get(name) != value
    }


def run_again_with_dense_caps(argv: list[str]) -> None:
    """From the command line, ``--isa`` below this CPU's: this script again, from the start,
    with dense's caps set (``DENSE_CAPS``); nothing where they are set or not needed."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--isa", default="auto")
    missing = missing_dense_caps(pre.parse_known_args(argv)[0].isa)
    if missing:
        os.execve(sys.executable, [sys.executable, __file__, *argv], os.environ | missing)


def alternating_medians(sides: dict[str, list], repeats: int) -> dict[str, float]:
    """Per side, the median over ``repeats`` rounds of the time per call; each round runs
    one pass of every side (each call with its own weight copy), the sides in turn, in the
    round's order of ``balanced_orders`` (``common.alternated_rounds``)."""
    for calls in sides.values():  # warm-up: pages touched, kernels built, plans made
        run_all(calls)
    rounds = alternated_rounds(
        {label: partial(run_all, calls) for label, calls in sides.items()}, repeats
    )
    return {
        label: statistics.median([seconds / len(sides[label]) for seconds in values])
        for label, values in rounds.items()
    }


def measure_shape(
    rows: int, columns: int, tokens: list[int], dtype, args, sparsity: str = "2:4"
) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from whisper_sparse.cpu.op import PATHS, PathThresholds, brgemm_kernel, gemm_runs
    from whisper_sparse.cpu.plans import cpu_plan

    dense_bytes = rows * columns * dtype.itemsize
    copies = max(2, -(-args.working_set * 2**20 // dense_bytes))
    dense, op_bytes, runs = op_layers(rows, columns, dtype, sparsity, copies)
    plan = cpu_plan(rows, columns, dtype, None if sparsity == "2:4" else 1 - float(sparsity))
    linear_for = vllm_dense_linear()
    try:
        vllm_dense = [linear_for(weight) for weight in dense] if linear_for else []
    except RuntimeError as error:  # oneDNN capped below its bfloat16 GEMM (--isa avx2)
        print(f"  vLLM's dense GEMM does not run here: {str(error).splitlines()[0]}")
        vllm_dense = []
    paths = {"op": plan} | {path: PathThresholds.only(path) for path in PATHS}
    gemm = gemm_runs(dtype, dtype)
    brgemm = gemm and brgemm_kernel() != "none"  # the micro-kernel's tiles, in bfloat16
    results = []
    with torch.no_grad():
        for count in tokens:
            x = torch.randn(count, columns).to(dtype)
            sides = {"dense": [lambda w=w, x=x: F.linear(x, w) for w in dense]}
            if vllm_dense:
                sides["vllm_dense"] = [lambda f=f, x=x: f(x) for f in vllm_dense]
            for label, thresholds in paths.items():
                if (
                    (label == "rows" and count > args.rows_up_to)
                    or (label in ("gemm", "lanes") and not gemm)
                    or (label == "lanes" and sparsity != "2:4")
                    or (label == "brgemm" and not brgemm)
                ):
                    continue
                sides[label] = [lambda r=r, t=thresholds, x=x: r(x, t) for r in runs]
            times = alternating_medians(sides, args.repeats)
            row = {
                "tokens": count,
                "seconds": times,
                "copies": copies,
                "ratio": times["dense"] / times["op"],
                "op_path": plan.path(count),
                "vllm_ratio": times["vllm_dense"] / times["op"] if vllm_dense else None,
                "op_bytes_ratio": op_bytes / dense_bytes,
                "op_gib_per_s": op_bytes / times["op"] / 2**30,
                "dense_gib_per_s": dense_bytes / times["dense"] / 2**30,
            }
            print(
                f"  {rows}x{columns} {sparsity} tokens {count}: dense "
                f"{times['dense'] * 1e3:.3f} ms, op {times['op'] * 1e3:.3f} ms "
                f"({row['op_path']}), {row['ratio']:.2f}x",
                flush=True,
            )
            results.append(row)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--projections", nargs="+", default=None, help="default: every one")
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "int8"],
        help="int8: W8A8 layers against vLLM's dense W8A8 layer (cpu_int8_op.py)",
    )
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
    parser.add_argument(
        "--isa",
        default="auto",
        choices=ISAS,
        help="cap the op's kernels at this instruction set, and dense alike (DENSE_CAPS): "
        "a lower kind of CPU, emulated on this one (files named ...-ISA-capped-on-OWN)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_sparse24")
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="write the table and plot of this JSON again, measuring nothing",
    )
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.repeats < 1 or args.working_set < 1:
        parser.error("--tokens, --repeats and --working-set must be at least 1")
    check_serving_sparsities(parser, args.sparsity)
    missing = missing_dense_caps(args.isa)
    if missing and args.replot is None:
        parser.error(
            f"--isa {args.isa} caps dense alike: start Python with "
            + " ".join(f"{name}={value}" for name, value in missing.items())
            + " (the command line does it)"
        )
    if args.replot is not None:
        write_results(args.replot.with_suffix(""), json.loads(args.replot.read_text()))
        return 0
    import torch

    from whisper_sparse.cpu.op import (
        cpu_isa,
        cpu_kernels_unavailable,
        set_cpu_isa,
        supported_isas,
    )

    reason = cpu_kernels_unavailable()
    if reason:
        print(f"the CPU op does not run here: {reason}")
        return 0
    if args.dtype == "int8":
        from cpu_int8_op import main as int8_main

        return int8_main(args)
    own = cpu_isa()
    if args.isa != "auto" and args.isa not in supported_isas():
        parser.error(f"--isa: this CPU runs {', '.join(supported_isas())}, not {args.isa}")
    capped_from = own if args.isa not in ("auto", own) else None
    if capped_from:
        set_cpu_isa(args.isa)
    dtype = getattr(torch, args.dtype)
    multi = args.sparsity != ["2:4"]
    stem = args.out / (
        f"{'cpu_sparse' if multi else 'cpu_sparse24'}-{cpu_isa()}"
        + (f"-capped-on-{capped_from}" if capped_from else "")
    )
    payload = {
        "cpu": cpu_line(capped_from),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "rows_up_to": args.rows_up_to,
        "repeats": args.repeats,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if multi:
        payload["sparsities"] = {s: {"shapes": {}} for s in args.sparsity}
    for sparsity in args.sparsity:
        shapes = (
            payload["sparsities"][sparsity]["shapes"] if multi else payload.setdefault("shapes", {})
        )
        for model in args.shapes:
            for projection, (rows, columns) in SHAPES[model].items():
                if args.projections and projection not in args.projections:
                    continue
                print(f"{model} {projection} {sparsity}", flush=True)
                shapes[f"{model}/{projection}"] = measure_shape(
                    rows, columns, args.tokens, dtype, args, sparsity
                )
                write_json(stem.with_suffix(".json"), payload)
    print(write_results(stem, payload))
    return 0


if __name__ == "__main__":
    run_again_with_dense_caps(sys.argv[1:])
    sys.exit(main())
