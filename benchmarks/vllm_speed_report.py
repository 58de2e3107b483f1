"""The report of ``vllm_speed.py``: each engine's rounds summed up, its ratios to dense,
and the Markdown table (with any profiles) and JSON it writes.

``write_report(out, payload)`` writes ``vllm_speed.md`` and ``vllm_speed.json`` from the
engines' rounds in ``payload["engines"]``; ``vllm_speed.py`` calls it after each engine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402

# resident memory after load, as it is and after the process's freed heap pages went back
RSS_FIELDS = ("rss_after_load", "rss_after_load_trimmed")


def sparsity_label(sparsity: str) -> str:
    """``2:4`` or an unstructured sparsity as a percentage (``0.65`` -> ``65%``)."""
    return sparsity if sparsity == "2:4" else f"{float(sparsity) * 100:g}%"


def summary(entry: dict) -> dict:
    """One engine's rounds as one result: the first round's settings and memory, and per
    workload the median over the rounds of its tokens/s (with every round's value);
    ``{"error": ...}`` if a round failed."""
    rounds = entry["rounds"]
    failed = next((result for result in rounds if "error" in result), None)
    if failed is not None:
        return failed
    result = dict(rounds[0])
    for field in RSS_FIELDS:
        result[field] = statistics.median(r.get(field) or 0 for r in rounds) or None
    result["workloads"] = {}
    for workload in rounds[0]["workloads"]:
        rates = [r["workloads"][workload]["tokens_per_s"] for r in rounds]
        result["workloads"][workload] = {"tokens_per_s": statistics.median(rates), "rounds": rates}
    return result


def with_ratios(results: dict) -> None:
    """Each workload's tokens/s over dense's at the same capture size (None without it),
    and the resident memory saved against dense over the 2:4 layers' dense weight bytes."""
    for key, result in results.items():
        dense = results.get(f"dense@{key.rsplit('@', 1)[1]}", {})
        for workload, cell in result.get("workloads", {}).items():
            base = dense.get("workloads", {}).get(workload)
            cell["ratio"] = cell["tokens_per_s"] / base["tokens_per_s"] if base else None
        result.update(rss_saved(dense, result))


def rss_saved(dense: dict, result: dict) -> dict:
    """``rss_saved`` and ``rss_saved_trimmed``: dense's resident memory after load less this
    engine's, over the dense bytes of its compressed layers' weights (None where unknown)."""
    dense_bytes = result.get("weights", {}).get("dense_bytes")
    return {
        saved: (dense[field] - result[field]) / dense_bytes
        if dense.get(field) and result.get(field) and dense_bytes
        else None
        for field, saved in zip(RSS_FIELDS, ("rss_saved", "rss_saved_trimmed"), strict=True)
    }


def write_report(out: Path, payload: dict) -> str:
    payload["results"] = {key: summary(entry) for key, entry in payload["engines"].items()}
    with_ratios(payload["results"])
    write_json(out / "vllm_speed.json", payload)
    text = markdown(payload)
    (out / "vllm_speed.md").write_text(text)
    return text


def markdown(payload: dict) -> str:
    config, engines = payload["config"], payload["results"]
    device = next((e["device"] for e in engines.values() if "device" in e), "?")
    workloads = config["workloads"]
    lines = [
        f"# vLLM serving speed: compressed {', '.join(map(sparsity_label, config['sparsity']))} "
        "against dense",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/vllm_speed.py` on {device}: "
        f"{config['shape']}-shaped Llama, {config['layers']} layers, {config['dtype']}, random "
        f"weights pruned by magnitude (2:4, or unstructured layer by layer: the bitmask "
        f"layout); {config['rounds']} rounds of the engines in turn, each workload "
        f"the median over the rounds of each engine's median of {config['repeats']} runs. "
        f"CPU: {payload.get('cpu', '?')}. Capture size 0 is vLLM's default "
        "`max_cudagraph_capture_size`; without CUDA graphs, a step runs compiled "
        "(torch.compile, vLLM's default on a CPU) or eager (`--enforce-eager`). Ratios are "
        "tokens/s over dense at the same capture size; weights are what the compressed layers "
        "hold over their dense bytes; RSS saved is dense's resident memory after load less "
        "this engine's, over those dense bytes; trimmed: the same once each engine's freed "
        "heap pages went back to the OS (`malloc_trim`, which the plugin calls after each "
        "compressed layer and dense vLLM does not), the memory each really holds.",
        "",
        "| engine | capture | CUDA graphs ≤ / step ≤ (tokens) | weights | RSS after load "
        "(GiB) | RSS saved | RSS saved, trimmed | " + " | ".join(workloads) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(workloads),
    ]
    for key, result in engines.items():
        label, capture = key.rsplit("@", 1)
        if "error" in result:
            lines.append(
                f"| {label} | {capture} | failed: {result['error']} | | | |" + " |" * len(workloads)
            )
            continue
        ratio = result["weights"].get("ratio")
        cells = []
        for workload in workloads:
            cell = result["workloads"][workload]
            rate = f"{cell['tokens_per_s']:,.0f}"
            cells.append(
                rate
                if cell["ratio"] is None or label == "dense"
                else f"{rate} ({cell['ratio']:.2f}×)"
            )
        weights = f"{ratio:.2f}×" if ratio is not None else "–"
        if result["weights"].get("packed_layers"):
            weights = "packed by vLLM's CPU GEMM"
        graphs = result["graphs"]
        compiled = graphs.get("compilation_mode", "NONE") != "NONE"
        steps = (
            f"{graphs['max_cudagraph_capture_size'] or ('compiled' if compiled else 'eager')}"
            f" / {graphs['max_num_batched_tokens']}"
        )
        rss = result.get("rss_after_load")
        rss = "–" if rss is None else f"{rss / 2**30:.2f}"
        saved = " | ".join(
            "–" if result.get(key) is None else f"{result[key]:.2f}×"
            for key in ("rss_saved", "rss_saved_trimmed")
        )
        lines.append(
            f"| {label} | {capture} | {steps} | {weights} | {rss} | {saved} | "
            + " | ".join(cells)
            + " |"
        )
    lines += profile_markdown(engines)
    return "\n".join(lines) + "\n"


def profile_markdown(engines: dict) -> list[str]:
    lines = []
    for key, result in engines.items():
        for workload, profile in result.get("profiles", {}).items():
            lines += [
                "",
                f"## Profile: {key}, {workload}",
                "",
                "| op | calls | self CPU (ms) | self device (ms) |",
                "|---|---|---|---|",
            ]
            for row in profile["top"]:
                cpu_ms, device_ms = row["self_cpu_us"] / 1e3, row["self_device_us"] / 1e3
                lines.append(
                    f"| `{row['op'][:80]}` | {row['calls']} | {cpu_ms:.2f} | {device_ms:.2f} |"
                )
            for name, entry in profile["watched"].items():
                per_call = entry["cpu_us_per_call"]
                per_call = "-" if per_call is None else f"{per_call:.1f}"
                lines += ["", f"`{name}`: {entry['calls']} calls, {per_call} µs CPU per call"]
    return lines
