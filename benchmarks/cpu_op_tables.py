"""The op benchmark's tables and plots (``cpu_sparse_op.py``'s results): one table per
layout, and over several sparsities a summary by sparsity with the plot of speed against
sparsity next to the bytes bound."""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path


def _wrapped(cpu: str) -> str:
    """The CPU line in lines that fit a plot's title (a capped run's line is long)."""
    return "\n".join(textwrap.wrap(cpu, 95))


def markdown(payload: dict) -> str:
    from whisper_sparse.cpu.op import PATHS  # the op's paths: columns

    vllm = any(row.get("vllm_ratio") for rows in payload["shapes"].values() for row in rows)
    lines = [
        f"# The sparse CPU op against dense `F.linear` ({payload['dtype']})",
        "",
        f"CPU: {payload['cpu']}",
        "",
        "Ratio: dense time / op time (above 1: the op is faster); the op as served "
        "(its measured plan picks row kernels, GEMM or tiles; lanes: a 2:4 layer "
        "in the unstructured GEMM, the tokens in the lanes; brgemm: blocks expanded "
        "once through a micro-kernel, the op's AMX tiles where the CPU has AMX, else "
        "oneDNN's). Each time is the median of rounds that run every side in turn. "
        "GiB/s: weight bytes read per second (compressed for the op); -: not measured "
        "(rows above "
        f"{payload['rows_up_to']} tokens; a path where it does not run)."
        + (
            " vLLM dense: vLLM's own CPU GEMM (`onednn_mm` on a weight oneDNN packed "
            "once), as its dense layers run; the last ratio is against it."
            if vllm
            else ""
        ),
        "",
        "| model | projection | tokens | dense ms | op ms | op path | ratio | "
        + "".join(f"{path} ms | " for path in PATHS)
        + "dense GiB/s | op GiB/s |"
        + (" vLLM dense ms | ratio to vLLM dense |" if vllm else ""),
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|" if vllm else ""),
    ]
    for key, rows in payload["shapes"].items():
        model, projection = key.split("/")
        for row in rows:
            s = row["seconds"]
            path_ms = " | ".join(f"{s[path] * 1e3:.3f}" if path in s else "-" for path in PATHS)
            against_vllm = (
                f" {s['vllm_dense'] * 1e3:.3f} | **{row['vllm_ratio']:.2f}×** |" if vllm else ""
            )
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
            axis.plot(
                tokens,
                [r["vllm_ratio"] for r in rows],
                linestyle="--",
                marker=".",
                color=line.get_color(),
            )
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens per call (M)")
    axis.set_ylabel("dense time / 2:4 op time\n(solid: F.linear; dashed: vLLM's oneDNN)")
    axis.set_title(f"sparse CPU op, {payload['dtype']}\n{_wrapped(payload['cpu'])}", fontsize=8)
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
    vllm = all(
        row.get("vllm_ratio")
        for entry in payload["sparsities"].values()
        for rows in entry["shapes"].values()
        for row in rows
    )
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
    lines = [
        f"# The CPU op against dense by sparsity ({payload['dtype']})",
        "",
        f"CPU: {payload['cpu']}",
        "",
        f"Each cell: dense time / op time against {against}, the median over the shapes "
        "(min–max); the op as served (its measured plan). Weight bytes: the compressed "
        "layout's over dense; bytes bound: their inverse, the most a memory-bound call "
        "can gain.",
        "",
        "| sparsity | weight bytes | bytes bound | "
        + " | ".join(f"{t} tokens" for t in tokens)
        + " |",
        "|---|---:|---:|" + "---:|" * len(tokens),
    ]
    for sparsity, cells in table.items():
        weight_bytes = bytes_ratio(payload, sparsity)
        ratios = [
            f"{statistics.median(cells[t]):.2f}× ({min(cells[t]):.2f}–{max(cells[t]):.2f})"
            if t in cells
            else "-"
            for t in tokens
        ]
        lines.append(
            f"| {sparsity} | {weight_bytes:.3f}× | {1 / weight_bytes:.2f}× | {' | '.join(ratios)} |"
        )
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
    axis.plot(
        [s for s, _ in unstructured], bound, color="black", linestyle="--", label="bytes bound"
    )
    for tokens in sorted({t for cells in table.values() for t in cells}):
        points = [
            (s, statistics.median(table[key][tokens]))
            for s, key in unstructured
            if tokens in table[key]
        ]
        (line,) = axis.plot(
            [s for s, _ in points], [r for _, r in points], marker="o", label=f"{tokens} tokens"
        )
        if tokens in table.get("2:4", {}):
            axis.plot(
                [0.5],
                [statistics.median(table["2:4"][tokens])],
                marker="*",
                markersize=11,
                color=line.get_color(),
                linestyle="none",
            )
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("unstructured sparsity (stars: 2:4)")
    axis.set_ylabel(f"{baseline_name(payload)} time / op time\n(median over shapes)")
    axis.set_title(
        f"CPU op against dense, {payload['dtype']}\n{_wrapped(payload['cpu'])}", fontsize=8
    )
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
