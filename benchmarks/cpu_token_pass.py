"""One decode step's decoder Linears on a CPU, layer after layer in model order, the CPU op
against dense: what the op gives a served model's step, between the op-level figures
(``cpu_sparse_op.py``: one shape, its copies cycled) and vLLM end to end.

    .venv-serve/bin/python benchmarks/cpu_token_pass.py --layers 8 --sparsity 2:4 0.5 0.65
    python benchmarks/cpu_token_pass.py --layers 2 --tokens 1 4 --dtype float32

A model of ``--layers`` layers shaped as ``cpu_layers.SHAPES[--shapes]`` (each projection as
vLLM runs it, qkv and gate_up fused), each layer with weights of its own (random: 2:4 by
magnitude, unstructured at random places; ``cpu_layers.op_layers``), so that a pass reads
every weight from memory, as a served model's step does. A pass calls every layer's
projections in turn at ``--tokens`` tokens. The sides: dense (vLLM's dense CPU GEMM as its
unquantized layers run it, where vLLM is installed, else ``F.linear``: the report says
which), and the op on each ``--sparsity``'s layout as the vLLM plugin holds it (2:4 rows;
unstructured ones grouped, ``cpu.grouped_layout``, on ``avx512_bf16`` kernels, else rows
spread, ``cpu.row_spread``) with its measured plan's paths. The sides take the rounds in
``common.balanced_orders``; a side's time is its median pass over
``--rounds`` rounds, its ratio the median of its rounds' dense time / its time (with the
lowest and highest), its read rate the weight bytes of a pass over its time; each
projection's median time is given too. Writes ``--name``.md and ``.json`` to ``--out``,
labelled by this CPU's line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    alternated_rounds,
    check_serving_sparsities,
    ratio_spread,
    write_json,
)
from cpu_layers import SHAPES, cpu_line, op_layers, vllm_dense_linear  # noqa: E402
from vllm_speed_report import sparsity_label  # noqa: E402


def model_sides(args, dtype) -> tuple[dict, dict, str]:
    """Per side, its pass (``(projection, call)`` for each layer's projections, in model order)
    and the weight bytes a pass reads; and the dense baseline's name."""
    import torch.nn.functional as F

    from whisper_sparse.cpu.plans import cpu_plan

    projections = SHAPES[args.shapes]
    linear_for = vllm_dense_linear()
    baseline = "vLLM's dense GEMM (onednn_mm)" if linear_for else "F.linear"
    layouts = [(sparsity_label(s), s, None) for s in args.sparsity]
    if args.rows:  # each unstructured sparsity again, its rows spread (grouped=False)
        layouts += [(f"{sparsity_label(s)} rows", s, False) for s in args.sparsity if s != "2:4"]
    passes = {"dense": [], **{side: [] for side, _, _ in layouts}}
    weight_bytes = dict.fromkeys(passes, 0)
    by_projection = {}
    for name, (rows, columns) in projections.items():
        for side, sparsity, grouped in layouts:
            dense, size, runs = op_layers(rows, columns, dtype, sparsity, args.layers, grouped)
            density = None if sparsity == "2:4" else 1 - float(sparsity)
            plan = cpu_plan(rows, columns, dtype, density)
            by_projection[name, side] = [lambda x, run=run, p=plan: run(x, p) for run in runs]
            weight_bytes[side] += size * args.layers
        calls = (
            [linear_for(w) for w in dense]
            if linear_for
            else [lambda x, w=w: F.linear(x, w) for w in dense]
        )
        by_projection[name, "dense"] = calls
        weight_bytes["dense"] += rows * columns * dtype.itemsize * args.layers
    for side, layer_pass in passes.items():
        for layer in range(args.layers):
            layer_pass += [(name, by_projection[name, side][layer]) for name in projections]
    return passes, weight_bytes, baseline


def time_passes(passes: dict, inputs: dict, rounds: int) -> dict:
    """Per side, each round's pass time and each projection's median time per call."""
    per_call = {side: {} for side in passes}

    def run(side, record):
        for name, call in passes[side]:
            start = time.perf_counter()
            call(inputs[name])
            if record:
                per_call[side].setdefault(name, []).append(time.perf_counter() - start)

    for side in passes:  # warm-up: kernels built, pages touched
        run(side, False)
    seconds = alternated_rounds({side: partial(run, side, True) for side in passes}, rounds)
    return {
        side: {
            "rounds": seconds[side],
            "projections": {
                name: statistics.median(times) for name, times in per_call[side].items()
            },
        }
        for side in passes
    }


def summarise(measured: dict, weight_bytes: dict) -> dict:
    dense = measured["dense"]["rounds"]
    results = {}
    for side, values in measured.items():
        ratios = [d / s for d, s in zip(dense, values["rounds"], strict=True)]
        seconds = statistics.median(values["rounds"])
        results[side] = {
            "seconds": seconds,
            **ratio_spread(ratios),
            "gb_per_s": weight_bytes[side] / seconds / 1e9,
            "weight_bytes": weight_bytes[side],
            "projections": values["projections"],
        }
    return results


def markdown(payload: dict) -> str:
    config = payload["config"]
    lines = [
        "# One decode step's decoder Linears on a CPU: the op against dense, layer after layer",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/cpu_token_pass.py`: "
        f"{config['shapes']} projections, {config['layers']} layers (weights of their own), "
        f"{config['dtype']}, {config['rounds']} rounds in balanced orders. Dense: "
        f"{payload['baseline']}. CPU: {payload['cpu']}. Ratio: dense's pass time over the "
        "side's in the same round (median, lowest–highest); GB/s: a pass's weight bytes "
        "over its median time.",
    ]
    for tokens, results in payload["results"].items():
        names = list(results["dense"]["projections"])
        lines += [
            "",
            f"## {tokens} token{'s' if tokens != '1' else ''}",
            "",
            "| side | weights (GB) | ms a pass | GB/s | ratio (lowest–highest) | "
            + " | ".join(f"{name} ms" for name in names)
            + " |",
            "|---|---|---|---|---|" + "---|" * len(names),
        ]
        for side, row in results.items():
            cells = [
                f"{row['weight_bytes'] / 1e9:.2f}",
                f"{row['seconds'] * 1e3:.2f}",
                f"{row['gb_per_s']:.1f}",
                f"**{row['ratio']:.2f}×** ({row['lowest']:.2f}–{row['highest']:.2f})",
            ]
            cells += [f"{row['projections'][name] * 1e3:.3f}" for name in names]
            lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="7B", choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--sparsity",
        nargs="+",
        default=["2:4", "0.5", "0.65"],
        help="the op's layouts: 2:4 and/or sparsities in (0, 1)",
    )
    parser.add_argument("--tokens", nargs="+", type=int, default=[1])
    parser.add_argument(
        "--rows",
        action="store_true",
        help="also each unstructured sparsity's layers held as rows (spread), "
        "as served where the grouped layout does not run; on the served "
        "layout's plan",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=36)
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_sparse24")
    parser.add_argument("--name", default="cpu_token_pass", help="the report's file name stem")
    args = parser.parse_args(argv)
    check_serving_sparsities(parser, args.sparsity)
    if args.layers < 1 or args.rounds < 1 or min(args.tokens) < 1:
        parser.error("--layers, --rounds and every --tokens must be at least 1")
    return args


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    passes, weight_bytes, baseline = model_sides(args, dtype)
    payload = {
        "config": vars(args) | {"out": str(args.out)},
        "cpu": cpu_line(),
        "baseline": baseline,
        "results": {},
    }
    with torch.no_grad():
        for tokens in args.tokens:
            inputs = {
                name: torch.randn(tokens, columns).to(dtype)
                for name, (_, columns) in SHAPES[args.shapes].items()
            }
            measured = time_passes(passes, inputs, args.rounds)
            payload["results"][str(tokens)] = summarise(measured, weight_bytes)
    write_json(args.out / f"{args.name}.json", payload)
    text = markdown(payload)
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
