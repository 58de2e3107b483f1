"""The report of ``vllm_paired.py``: per engine and workload, the median rate over the rounds
and the ratios to dense round by round (median, lowest, highest), with what each engine
holds; and the Markdown tables of them.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ratio_spread  # noqa: E402
from vllm_speed_report import rss_saved  # noqa: E402
from w8a8_checkpoints import DENSE_W8A8  # noqa: E402

BASELINES = ("dense", DENSE_W8A8)  # the engines others are compared with, where they ran


def summarise(payload: dict) -> dict:
    """``{label: {"weights", "rss_after_load", "rss_saved", "rss_saved_trimmed",
    "workloads": {name: {"tokens_per_s", "ratios", "ratio", "lowest", "highest"}}}}``:
    ratios per round against dense's rate in the same round. Where a dense W8A8 engine ran,
    each compressed engine also has ``against_w8a8`` (its RSS saved) and each of its cells
    ``against_w8a8`` (its ratios) against that engine."""
    loaded = {label: entry["loaded"] for label, entry in payload["engines"].items()}
    dense = loaded.get("dense", {})
    results = {}
    for label, result in loaded.items():
        results[label] = {
            "weights": result.get("weights", {}).get("ratio"),
            "rss_after_load": result.get("rss_after_load"),
            **rss_saved(dense, result),
            "workloads": {},
        }
        if DENSE_W8A8 in loaded and label not in BASELINES:
            results[label]["against_w8a8"] = rss_saved(loaded[DENSE_W8A8], result)
    for workload, runs in payload["runs"].items():
        for label, rates in runs.items():
            if not rates:
                continue
            cell = {"tokens_per_s": statistics.median(rates), "rounds": rates}
            for baseline in BASELINES:
                base = runs.get(baseline, [])[: len(rates)]
                if label == baseline or not base:
                    continue
                ratios = [
                    rate / rate_of_base for rate, rate_of_base in zip(rates, base, strict=False)
                ]
                spread = {"ratios": ratios, **ratio_spread(ratios)}
                cell |= spread if baseline == "dense" else {"against_w8a8": spread}
            results[label]["workloads"][workload] = cell
    return results


def markdown(payload: dict) -> str:
    config, results = payload["config"], payload["results"]
    lines = [
        "# vLLM serving speed: compressed engines against dense, held open and timed in turn",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/vllm_paired.py`: "
        f"{config['shape']}-shaped Llama, {config['layers']} layers, {config['dtype']}, random "
        f"weights pruned by magnitude, kernel mode {config['mode']}"
        f"{', eager' if config['enforce_eager'] else ', compiled'}; {config['rounds']} rounds, "
        f"each in a balanced order and its mirror (over a cycle of rounds every engine takes "
        f"every place), {config['settle']:g} s between runs. "
        f"CPU: {payload.get('cpu', '?')}. A ratio is an engine's tokens/s over dense's in the "
        "same round; weights are what the compressed layers hold over their dense bytes; RSS "
        "saved is dense's resident memory after load less this engine's, over those bytes "
        "(trimmed: once each engine's freed heap pages went back to the OS).",
    ]
    if "error" in payload:
        lines += ["", f"**Stopped:** {payload['error'].splitlines()[0]}"]
    workloads = list(payload["runs"])
    lines += [
        "",
        "| engine | weights | RSS after load (GiB) | RSS saved | RSS saved, trimmed | "
        + " | ".join(f"{w}: tokens/s | ratio (lowest–highest)" for w in workloads)
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(workloads),
    ]
    for label, result in results.items():
        cells = [
            number(result["weights"], "×"),
            number(result["rss_after_load"], "", 2**30),
            number(result["rss_saved"], "×"),
            number(result["rss_saved_trimmed"], "×"),
        ]
        for workload in workloads:
            cell = result["workloads"].get(workload, {})
            cells.append(number(cell.get("tokens_per_s"), "", 1, ".1f"))
            cells.append(
                f"**{cell['ratio']:.2f}×** ({cell['lowest']:.2f}–{cell['highest']:.2f})"
                if "ratio" in cell
                else "–"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if DENSE_W8A8 in results:
        lines += w8a8_table(workloads, results)
    for workload in workloads:
        lines += rounds_table(workload, results)
    return "\n".join(lines) + "\n"


def w8a8_table(workloads: list[str], results: dict) -> list[str]:
    """The compressed engines against dense W8A8: RSS saved over their dense weight bytes,
    and per workload the median, lowest and highest of the per-round ratios."""
    lines = [
        "",
        f"## Against {DENSE_W8A8}",
        "",
        "| engine | RSS saved | RSS saved, trimmed | "
        + " | ".join(f"{w}: ratio (lowest–highest)" for w in workloads)
        + " |",
        "|---|---|---|" + "---|" * len(workloads),
    ]
    for label, result in results.items():
        if "against_w8a8" not in result:
            continue
        saved = result["against_w8a8"]
        cells = [number(saved["rss_saved"], "×"), number(saved["rss_saved_trimmed"], "×")]
        for workload in workloads:
            cell = result["workloads"].get(workload, {}).get("against_w8a8")
            cells.append(
                f"**{cell['ratio']:.2f}×** ({cell['lowest']:.2f}–{cell['highest']:.2f})"
                if cell
                else "–"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def rounds_table(workload: str, results: dict) -> list[str]:
    """Every round of ``workload``: dense's tokens/s and each engine's ratio."""
    labels = [label for label in results if label != "dense"]
    dense = results.get("dense", {}).get("workloads", {}).get(workload, {}).get("rounds", [])
    lines = [
        "",
        f"## {workload}, round by round",
        "",
        "| round | dense tokens/s | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for index, rate in enumerate(dense):
        ratios = []
        for label in labels:
            values = results[label]["workloads"].get(workload, {}).get("ratios", [])
            ratios.append(f"{values[index]:.2f}×" if index < len(values) else "–")
        lines.append(f"| {index + 1} | {rate:.1f} | " + " | ".join(ratios) + " |")
    return lines


def number(value, unit: str, scale: float = 1, spec: str = ".2f") -> str:
    return "–" if value is None else f"{value / scale:{spec}}{unit}"
