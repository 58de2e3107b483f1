"""The report of ``sparse_kernels.py``: its Markdown table, JSON and PNG plot.

``write_tables(out, payload)`` writes ``sparse_kernels.md``, ``sparse_kernels.json`` and
``sparse_kernels.png`` from the payload that ``sparse_kernels.main`` measured (or from a
stored JSON, to draw it again).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402


def write_tables(out: Path, payload: dict) -> None:
    lines = [
        f"# 2:4 sparse GEMMs against dense ({payload['gpu']})",
        "",
        f"torch {payload['torch']}, cuSPARSELt {payload['cusparselt']}, {payload['dtype']}. "
        "Ratios are dense time / other time (above 1 is faster).",
        "",
    ]
    if payload.get("per_shape"):
        lines += ["## Per shape: dense / always sparse (dense / dispatched)", ""]
        tokens = sorted({r["tokens"] for r in payload["per_shape"]})
        lines += [
            "| model | projection | (out, in) | sparse from | "
            + " | ".join(str(t) for t in tokens)
            + " |",
            "|" + "---|" * (4 + len(tokens)),
        ]
        keys = dict.fromkeys((r["model"], r["projection"]) for r in payload["per_shape"])
        for model, projection in keys:
            cells = [
                r
                for r in payload["per_shape"]
                if r["model"] == model and r["projection"] == projection
            ]
            start = cells[0]["sparse_from"]
            lines.append(
                f"| {model} | {projection} | {tuple(cells[0]['shape'])} | "
                f"{start if start < 1 << 40 else 'never'} | "
                + " | ".join(f"{c['sparse_ratio']:.2f} ({c['dispatch_ratio']:.2f})" for c in cells)
                + " |"
            )
        lines.append("")
    if payload.get("end_to_end"):
        rows = payload["end_to_end"]
        lines += [
            f"## End to end: Llama-7B-shaped, {rows[0]['layers']} layers, one forward",
            "",
            "| modules | batch × sequence | tokens | dense ms | dispatched | always sparse "
            "| timing |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            mode = "torch.compile" if r["compiled"] else "eager"
            lines.append(
                f"| {mode} | {r['batch']}×{r['sequence']} | {r['tokens']} | {r['dense_ms']:.3f} | "
                f"{r['dispatch_ratio']:.2f}× | {r['sparse_ratio']:.2f}× | {r['timing']} |"
            )
        lines.append("")
    (out / "sparse_kernels.md").write_text("\n".join(lines) + "\n")
    write_json(out / "sparse_kernels.json", payload)
    plot(out, payload)


def plot(out: Path, payload: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for model, projection in dict.fromkeys(
        (r["model"], r["projection"]) for r in payload.get("per_shape", [])
    ):
        cells = [
            r for r in payload["per_shape"] if (r["model"], r["projection"]) == (model, projection)
        ]
        axes[0].plot(
            [c["tokens"] for c in cells],
            [c["sparse_ratio"] for c in cells],
            marker=".",
            label=f"{model} {projection}",
        )
    axes[0].set(
        xscale="log",
        xlabel="tokens",
        ylabel="dense time / sparse time",
        title="cuSPARSELt 2:4, always sparse",
    )
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=6, ncol=2)
    rows = payload.get("end_to_end", [])
    if rows:
        for compiled in sorted({r["compiled"] for r in rows}):
            part = [r for r in rows if r["compiled"] == compiled]
            tokens = [r["tokens"] for r in part]
            mode = "compiled" if compiled else "eager"
            axes[1].plot(
                tokens, [r["dispatch_ratio"] for r in part], marker="o", label=f"dispatched, {mode}"
            )
            axes[1].plot(
                tokens,
                [r["sparse_ratio"] for r in part],
                marker="x",
                ls="--",
                label=f"always sparse, {mode}",
            )
        axes[1].axhline(1.0, color="grey", lw=0.8)
        axes[1].set(
            xscale="log",
            xlabel="tokens per forward",
            ylabel="dense time / 2:4 time",
            title=f"Llama-7B-shaped forward ({rows[0]['layers']} layers)",
        )
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "sparse_kernels.png", dpi=120)
    plt.close(fig)
