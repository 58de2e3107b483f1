"""Speed against sparsity for bfloat16 and int8 together, beside their bytes bounds: the op
benchmark's results of one CPU kind (``cpu_sparse_op.py`` over several sparsities, in
bfloat16 and with ``--dtype int8``, one run or more of each), drawn against one baseline,
vLLM's dense bfloat16 layer, with dense W8A8 as a line of its own.

- bf16 op: the bfloat16 run's ratio against dense bfloat16 (``cpu_op_tables.baseline_ratio``);
- int8 op and dense W8A8: the int8 run's ``vs_bf16`` of its served path, and its dense
  bfloat16 time over its dense W8A8 time;
- bytes bounds: dense bfloat16's weight bytes over each layout's, 2 bytes a weight against
  ``(1 - s) 2 + 1/8`` (bfloat16) and ``(1 - s) + 1/8`` (int8).

Each point is the median over the shapes of the two runs (each cell itself a median of
alternated rounds); the runs are separate, so the two dtypes' dense bfloat16 times differ by
the machine's drift between them. Writes STEM.png (where matplotlib is installed) and STEM.md.

  .venv/bin/python benchmarks/sparsity_plot.py --bf16 B.json --int8 I.json [I2.json] --out STEM
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cpu_op_tables import baseline_ratio


def sparsity_of(key: str) -> float:
    """A results key's sparsity: 2:4 is drawn at 0.5."""
    return 0.5 if key == "2:4" else float(key)


def medians(payload: dict, tokens: int, value) -> dict[str, float]:
    """Per sparsity key, the median over the shapes of ``value(row)`` at ``tokens``."""
    table = {}
    for key, shapes in payload["sparsities"].items():
        rows = shapes.get("shapes", shapes)  # the bfloat16 run nests its shapes one deeper
        cells = [value(r) for rs in rows.values() for r in rs if r["tokens"] == tokens]
        if cells:
            table[key] = statistics.median(cells)
    return table


def series(bf16: dict, int8: dict, tokens: int) -> dict[str, dict[str, float]]:
    """The plotted values at ``tokens``: name -> sparsity key -> speed over dense bfloat16."""
    return {
        "bf16 op": medians(bf16, tokens, baseline_ratio),
        "int8 op": medians(int8, tokens, lambda r: r["vs_bf16"][r["best"]]),
        "dense W8A8": medians(int8, tokens, lambda r: r["seconds"]["bf16"] / r["seconds"]["w8a8"]),
    }


def bytes_bound(sparsity: float, int8: bool) -> float:
    """Dense bfloat16's weight bytes over the bitmask layout's at ``sparsity``."""
    return 2 / ((1 - sparsity) * (1 if int8 else 2) + 1 / 8)


def markdown(bf16: dict, int8: dict, token_counts: list[int]) -> str:
    lines = [
        "# Speed against sparsity, bfloat16 and int8 (op benchmark)",
        "",
        f"CPU (bfloat16 run): {bf16['cpu']}",
        f"CPU (int8 run): {int8['cpu']}",
        "",
        "Each cell: vLLM's dense bfloat16 layer's time over the side's, the median over the "
        "shapes; bytes bound: dense bfloat16's weight bytes over the layout's (2:4 counted "
        "as 50 %).",
        "",
        "| tokens | sparsity | bf16 op | bf16 bound | int8 op | int8 bound | dense W8A8 |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for tokens in token_counts:
        values = series(bf16, int8, tokens)
        keys = sorted({k for v in values.values() for k in v}, key=lambda k: (sparsity_of(k), k))
        for key in keys:
            s = sparsity_of(key)
            cells = [f"{values[n][key]:.2f}×" if key in values[n] else "-" for n in values]
            lines.append(
                f"| {tokens} | {key} | {cells[0]} | {bytes_bound(s, False):.2f}× | {cells[1]} "
                f"| {bytes_bound(s, True):.2f}× | {cells[2]} |"
            )
    return "\n".join(lines) + "\n"


def plot(bf16: dict, int8: dict, token_counts: list[int], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib here: {path.name} not drawn")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(token_counts), figsize=(5 * len(token_counts), 4.2))
    axes = [axes] if len(token_counts) == 1 else list(axes)
    grid = [i / 100 for i in range(45, 76)]
    for axis, tokens in zip(axes, token_counts, strict=True):
        for name, values in series(bf16, int8, tokens).items():
            unstructured = sorted((sparsity_of(k), v) for k, v in values.items() if k != "2:4")
            (line,) = axis.plot(
                [s for s, _ in unstructured], [v for _, v in unstructured], marker="o", label=name
            )
            if "2:4" in values:
                axis.plot(
                    [0.5],
                    [values["2:4"]],
                    marker="*",
                    markersize=11,
                    linestyle="none",
                    color=line.get_color(),
                )
            if name != "dense W8A8":
                bound = [bytes_bound(s, name == "int8 op") for s in grid]
                axis.plot(
                    grid,
                    bound,
                    linestyle="--",
                    color=line.get_color(),
                    label=f"{name.split()[0]} bytes bound",
                )
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"{tokens} token{'s' if tokens > 1 else ''}", fontsize=9)
        axis.set_xlabel("sparsity (stars: 2:4)")
        axis.set_ylabel("dense bf16 time / side's time (median over shapes)")
        axis.legend(fontsize=7)
    figure.suptitle(f"Speed against sparsity, bf16 and int8\n{int8['cpu']}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def merged(paths: list[Path]) -> dict:
    """The first run's payload with every run's sparsities (a later run's win)."""
    payloads = [json.loads(path.read_text()) for path in paths]
    sparsities = {k: v for p in payloads for k, v in p.get("sparsities", {}).items()}
    return payloads[0] | {"sparsities": sparsities}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--bf16", type=Path, nargs="+", required=True, help="cpu_sparse_op.py JSONs"
    )
    parser.add_argument(
        "--int8", type=Path, nargs="+", required=True, help="... --dtype int8 JSONs"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", type=Path, required=True, help="the files' stem")
    args = parser.parse_args(argv)
    bf16, int8 = merged(args.bf16), merged(args.int8)
    if "int8_kernels" in bf16 or "dtype" not in bf16 or not bf16["sparsities"]:
        parser.error("--bf16 must be a bfloat16 run of cpu_sparse_op.py over several sparsities")
    if "int8_kernels" not in int8:
        parser.error("--int8 must be a run of cpu_sparse_op.py --dtype int8")
    text = markdown(bf16, int8, args.tokens)
    args.out.with_suffix(".md").write_text(text)
    plot(bf16, int8, args.tokens, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
