"""The W8A8 CPU op (``whisper_sparse.cpu.int8_op``) against the dense W8A8 layer served here
and vLLM's dense bf16 GEMM, per Llama projection and token count: ``cpu_sparse_op.py --dtype
int8``.

    .venv-serve/bin/python benchmarks/cpu_sparse_op.py --dtype int8 --sparsity 2:4 0.65

For each sparsity, random int8 weights (-127..127, a float32 scale per row) are pruned (2:4 by
magnitude, or unstructured keeping ``1 - sparsity`` anywhere) and stored compressed. Sides:
the dense W8A8 layer on the same pruned weight served dense (``cpu_layers.vllm_w8a8_linear``:
vLLM's AMX kernel where it takes the shape, else its oneDNN layer, or where that saturates the
plugin's ``ExactInt8Linear``; activation quantization included); vLLM's
dense bf16 GEMM on the dequantized weight; and the op's paths, each with its own per-token
quantization in the rounding of vLLM's kernel for the shape (``int8_quantize``, as the plugin
serves it): ``rows`` (the row kernels, up to ``--rows-up-to`` tokens) and, where AMX-INT8
runs, ``tiles``. Weight copies are cycled past the caches; the sides alternate
(``common.alternated_rounds``) and every ratio is the median of the rounds' ratios (baseline
time / op time: above 1 the op is faster). Before timing, each path's output is compared with
vLLM's dense W8A8 layer on the same weight (``exact`` in the JSON). Writes
``cpu_sparse_int8-KERNELS.md`` and ``.json``.
"""

from __future__ import annotations

import statistics
from functools import partial

from common import alternated_rounds, ratio_spread, write_json
from cpu_layers import SHAPES, cpu_line, run_all, vllm_dense_linear, vllm_w8a8_linear

TOKENS = [1, 4, 16, 64, 512]


def pruned_int8(rows: int, columns: int, sparsity: str, generator):
    """A random int8 weight pruned to the layout, and its per-row scales ``[rows, 1]``."""
    import torch

    weight = torch.randint(-127, 128, (rows, columns), dtype=torch.int8, generator=generator)
    if sparsity == "2:4":
        groups = weight.reshape(rows, -1, 4)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(-1, groups.to(torch.int16).abs().topk(2, dim=-1).indices, True)
        weight = (groups * keep).reshape(rows, columns)
    else:
        weight = weight * (torch.rand(rows, columns, generator=generator) >= float(sparsity))
    return weight, torch.rand(rows, 1, generator=generator) * 1e-3 + 1e-4


def op_paths():
    """The op's paths here: name -> tiles_from."""
    from whisper_sparse.cpu.int8_op import int8_paths

    return int8_paths()


def op_call(weight, scales, sparsity: str):
    """``(tiles_from, x) -> y``: the op's quantization, then the op on the stored layer, both in
    the rounding of vLLM's W8A8 kernel for the shape."""
    from whisper_sparse.cpu.int8_op import int8_cpu_linear, int8_quantize
    from whisper_sparse.format.bitmask import compress_bitmask
    from whisper_sparse.format.two_four import compress_24
    from whisper_sparse.vllm_adapter.w8a8 import vllm_w8a8_rounding

    rows, columns = weight.shape
    rounding = vllm_w8a8_rounding(rows, columns)
    if sparsity == "2:4":
        values, bitmask = compress_24(weight)
        offsets = None
    else:
        values, bitmask, offsets = compress_bitmask(weight)
    row_scales = scales.reshape(-1).contiguous()

    def call(tiles_from, x):
        x_q, x_s = int8_quantize(x, rounding)
        return int8_cpu_linear(
            x_q,
            x_s,
            values,
            bitmask,
            row_scales,
            columns,
            offsets,
            None,
            x.dtype,
            tiles_from,
            rounding,
        )

    stored = values.numel() + bitmask.numel() + (0 if offsets is None else offsets.numel() * 8)
    return call, stored


def measure_shape(rows: int, columns: int, sparsity: str, args) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(0)
    copies = max(2, -(-args.working_set * 2**20 // (rows * columns)))
    bf16_for, w8a8_for = vllm_dense_linear(), vllm_w8a8_linear()
    paths = op_paths()
    bf16, w8a8, ops_, stored = [], [], [], 0
    for _ in range(copies):
        weight, scales = pruned_int8(rows, columns, sparsity, generator)
        w8a8.append(w8a8_for(weight, scales))
        bf16.append(bf16_for((weight.float() * scales).to(torch.bfloat16)))
        call, stored = op_call(weight, scales, sparsity)
        ops_.append(call)
    results = []
    with torch.no_grad():
        for count in args.tokens:
            x = torch.randn(count, columns, generator=generator).to(torch.bfloat16)
            timed = {  # the row kernels up to --rows-up-to tokens
                p: t for p, t in paths.items() if p != "rows" or count <= args.rows_up_to
            }
            exact = {p: torch.equal(ops_[0](t, x), w8a8[0](x)) for p, t in timed.items()}
            sides = {
                "w8a8": [partial(f, x) for f in w8a8],
                "bf16": [partial(f, x) for f in bf16],
            } | {p: [partial(f, t, x) for f in ops_] for p, t in timed.items()}
            passes = {label: partial(run_all, calls) for label, calls in sides.items()}
            for run in passes.values():
                run()
            rounds = alternated_rounds(passes, args.repeats)
            row = {
                "tokens": count,
                "copies": copies,
                "w8a8_path": w8a8[0].path,
                "exact": exact,
                "seconds": {k: statistics.median(v) / copies for k, v in rounds.items()},
                "vs_w8a8": {p: ratio(rounds["w8a8"], rounds[p]) for p in timed},
                "vs_bf16": {p: ratio(rounds["bf16"], rounds[p]) for p in timed},
                "stored_ratio": stored / (rows * columns),
            }
            best = max(timed, key=lambda p: row["vs_w8a8"][p])
            row["best"] = best
            print(
                f"  {rows}x{columns} {sparsity} tokens {count}: W8A8 "
                f"{row['seconds']['w8a8'] * 1e3:.3f} ms, op {row['seconds'][best] * 1e3:.3f} ms "
                f"({best}), {row['vs_w8a8'][best]:.2f}x W8A8, {row['vs_bf16'][best]:.2f}x bf16, "
                f"exact {exact}",
                flush=True,
            )
            results.append(row)
    return results


def ratio(baseline: list[float], side: list[float]) -> float:
    """The median of the rounds' ratios (``common.ratio_spread``)."""
    return ratio_spread([b / s for b, s in zip(baseline, side, strict=True)])["ratio"]


def markdown(payload: dict) -> str:
    tokens = payload["tokens"]
    dense_paths = sorted(
        {
            r["w8a8_path"]
            for shapes in payload["sparsities"].values()
            for rows in shapes.values()
            for r in rows
        }
    )
    lines = [
        "# The W8A8 CPU op against the dense W8A8 layer served here",
        "",
        f"CPU: {payload['cpu']}; W8A8 kernels: {payload['int8_kernels']}; the dense W8A8 layer: "
        f"{', '.join(dense_paths)}. Each cell: the dense W8A8 time / the op's (above 1: the op "
        f"is faster), the median of {payload['repeats']} alternated rounds' ratios, on the op's "
        "faster path (rows: the row kernels; tiles: AMX-INT8, the VNNI or the 256-bit tiles), "
        "activation quantization included on both sides; in brackets against vLLM's dense "
        "bf16 GEMM. `exact`: the op's output equals the dense W8A8 layer on the same weight, "
        "bit for bit.",
    ]
    for sparsity, shapes in payload["sparsities"].items():
        lines += [
            "",
            f"## {sparsity}",
            "",
            "| shape | stored / dense int8 | "
            + " | ".join(f"{t} tokens" for t in tokens)
            + " | exact |",
            "|---|---:|" + "---:|" * len(tokens) + "---|",
        ]
        for name, rows in shapes.items():
            cells = [
                f"{r['vs_w8a8'][r['best']]:.2f}× {r['best']} ({r['vs_bf16'][r['best']]:.2f}×)"
                for r in rows
            ]
            exact = all(all(r["exact"].values()) for r in rows)
            lines.append(
                f"| {name} | {rows[0]['stored_ratio']:.3f} | "
                + " | ".join(cells)
                + f" | {'yes' if exact else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def main(args) -> int:
    from whisper_sparse.cpu.int8_op import int8_kernels

    kernels = int8_kernels()
    if kernels == "none" or vllm_w8a8_linear() is None:
        print(f"the W8A8 op or vLLM's CPU int8 ops do not run here (int8_kernels: {kernels})")
        return 0
    tokens = args.tokens
    payload = {
        "cpu": cpu_line(),
        "int8_kernels": kernels,
        "tokens": tokens,
        "repeats": args.repeats,
        "sparsities": {s: {} for s in args.sparsity},
    }
    stem = args.out / f"cpu_sparse_int8-{kernels}"
    for sparsity in args.sparsity:
        for model in args.shapes:
            for projection, (rows, columns) in SHAPES[model].items():
                if args.projections and projection not in args.projections:
                    continue
                print(f"{model} {projection} {sparsity} int8", flush=True)
                payload["sparsities"][sparsity][f"{model}/{projection}"] = measure_shape(
                    rows, columns, sparsity, args
                )
                write_json(stem.with_suffix(".json"), payload)
    stem.with_suffix(".md").write_text(markdown(payload))
    print(markdown(payload))
    return 0
