"""vLLM's dense W8A8 layer against its dense bf16 GEMM on this CPU: the baseline a sparse
int8 op has to beat, per Llama projection and token count.

    .venv-serve/bin/python benchmarks/cpu_int8_baseline.py --shapes 7B 8B --tokens 1 4 16 64 512

The W8A8 side is what vLLM's CPU int8 kernel (``CPUInt8ScaledMMLinearKernel``) runs for a
W8A8 checkpoint (int8 weights with per-channel scales, per-token dynamic symmetric int8
activations): on an AMX CPU ``int8_scaled_mm_with_quant`` over the packed weight (its sgl
path), elsewhere ``onednn_scaled_int8_quant`` then ``onednn_scaled_mm`` on a oneDNN handle
made once per weight, and where that saturates (no VNNI) the plugin's ``ExactInt8Linear``,
which the plugin serves there instead; the activation quantization is timed with the GEMM.
The bf16 side is vLLM's unquantized CPU GEMM (``onednn_mm``, or its torch fallback). Each
side holds enough weight copies to pass the caches and cycles through them; the two sides run
in turn, round after round
(``common.balanced_orders``), and each cell is the median of the rounds' ratios
(bf16 time / W8A8 time: above 1, W8A8 is faster). Writes ``--name``.md and ``.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, alternated_rounds, ratio_spread, run_stamp, write_json  # noqa: E402
from cpu_layers import (  # noqa: E402
    SHAPES,
    cpu_line,
    run_all,
    vllm_dense_linear,
    vllm_w8a8_linear,
)


def measure(rows: int, columns: int, tokens: list[int], args, bf16_for, w8a8_for) -> list[dict]:
    import torch

    copies = max(2, -(-args.working_set * 2**20 // (rows * columns * 2)))
    generator = torch.Generator().manual_seed(0)
    bf16, w8a8 = [], []
    for _ in range(copies):
        weight = torch.randint(-127, 128, (rows, columns), dtype=torch.int8, generator=generator)
        scales = torch.rand(rows, 1, generator=generator) * 1e-3 + 1e-4
        w8a8.append(w8a8_for(weight, scales))
        bf16.append(bf16_for((weight.float() * scales).to(torch.bfloat16)))
    results = []
    with torch.no_grad():
        for count in tokens:
            x = torch.randn(count, columns, generator=generator).to(torch.bfloat16)
            sides = {
                "bf16": [lambda f=f, x=x: f(x) for f in bf16],
                "w8a8": [lambda f=f, x=x: f(x) for f in w8a8],
            }
            passes = {label: partial(run_all, calls) for label, calls in sides.items()}
            for run in passes.values():  # warm: oneDNN makes its primitives on first use
                run()
            # the same weights (W8A8's dequantized): only the activations' rounding differs
            reference = bf16[0](x).float()
            error = (w8a8[0](x).float() - reference).norm() / reference.norm()
            seconds = {  # per call: each pass runs every copy once
                label: [t / copies for t in rounds]
                for label, rounds in alternated_rounds(passes, args.rounds).items()
            }
            ratios = [b / w for b, w in zip(seconds["bf16"], seconds["w8a8"], strict=True)]
            row = {
                "tokens": count,
                "copies": copies,
                "seconds": {label: statistics.median(s) for label, s in seconds.items()},
                "rounds": seconds,
                "relative_error": float(error),
                "w8a8_path": w8a8[0].path,
            } | ratio_spread(ratios)
            print(
                f"  {rows}x{columns} tokens {count}: bf16 {row['seconds']['bf16'] * 1e3:.3f} ms,"
                f" W8A8 {row['seconds']['w8a8'] * 1e3:.3f} ms, {row['ratio']:.2f}x",
                flush=True,
            )
            results.append(row)
    return results


def all_entries(payload: dict) -> list[dict]:
    """Every measured projection's entry of ``payload``."""
    return [entry for projections in payload["shapes"].values() for entry in projections.values()]


def markdown(payload: dict) -> str:
    tokens = payload["config"]["tokens"]
    lines = [
        "# vLLM's dense W8A8 layer against its dense bf16 GEMM",
        "",
        f"Generated {payload['date'][:10]} by `benchmarks/cpu_int8_baseline.py` on main "
        f"`{payload['commit']}`. CPU: {payload['cpu']}. Each cell: bf16 time / W8A8 time "
        "(above 1: W8A8 is faster), the median of the rounds' ratios "
        f"({payload['config']['rounds']} rounds, the sides in turn), lowest–highest; the W8A8 "
        f"side is `{payload['w8a8_path']}`, activation quantization included.",
        "",
        "| model | projection | shape | " + " | ".join(f"{t} tokens" for t in tokens) + " |",
        "|---|---|---|" + "---:|" * len(tokens),
    ]
    for model, projections in payload["shapes"].items():
        for projection, entry in projections.items():
            cells = [
                f"{row['ratio']:.2f}× ({row['lowest']:.2f}–{row['highest']:.2f})"
                for row in entry["rows"]
            ]
            shape = f"{entry['shape'][0]} × {entry['shape'][1]}"
            lines.append(f"| {model} | {projection} | {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["7B"], choices=list(SHAPES))
    parser.add_argument("--projections", nargs="+", default=None, help="default: every one")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 512])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--working-set", type=int, default=512, help="MiB of weights a side cycles")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_int8")
    parser.add_argument("--name", default="cpu_int8_baseline")
    args = parser.parse_args(argv)
    if args.rounds < 5 or any(t < 1 for t in args.tokens):
        parser.error("--rounds must be at least 5 and every --tokens count at least 1")
    bf16_for, w8a8_for = vllm_dense_linear(), vllm_w8a8_linear()
    if bf16_for is None or w8a8_for is None:
        print("vLLM's CPU ops are not importable: run with the serving environment's Python")
        return 2
    payload = {
        "config": vars(args) | {"out": str(args.out)},
        "cpu": cpu_line(),
        **run_stamp(),
        "w8a8_path": "",
        "shapes": {},
    }
    for model in args.shapes:
        for projection, (rows, columns) in SHAPES[model].items():
            if args.projections and projection not in args.projections:
                continue
            rows_measured = measure(rows, columns, args.tokens, args, bf16_for, w8a8_for)
            payload["shapes"].setdefault(model, {})[projection] = {
                "shape": [rows, columns],
                "rows": rows_measured,
            }
            paths = {row["w8a8_path"] for entry in all_entries(payload) for row in entry["rows"]}
            payload["w8a8_path"] = ", ".join(sorted(paths))
            write_json(args.out / f"{args.name}.json", payload)
    (args.out / f"{args.name}.md").write_text(markdown(payload))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
