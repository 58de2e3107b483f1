"""The README's results table, generated from the latest result files.

    python benchmarks/summary.py                  # print the table
    python benchmarks/summary.py --write README.md   # put it between the README's markers
    python benchmarks/summary.py --check README.md   # exit 1 where the README's differs

Three kinds of rows, each from the latest file that measured it (a file's date is its JSON
``date`` or its report's "Generated" line; files of one day are ordered by
``results/JOURNAL.md``, newest first), and the files named under the table:
- perplexity of SmolLM2-135M on WikiText-2, the paper's methods beside their baselines,
  from ``quality.py`` runs of the CPU protocol with at least 3 seeds: mean ± standard error
  and the worst seed;
- the checkpoint's size, from ``serving.py``;
- vLLM end to end against dense bf16, per CPU kind measured natively (never with the
  kernels capped), from ``vllm_paired.py`` (median of per-round ratios) or ``vllm_speed.py``
  (best of its runs), with the kernel mode ``auto``.
A kind measured only at the op level is named below the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- results-table: benchmarks/summary.py -->", "<!-- /results-table -->"
SPARSITIES = {"2:4": "2:4", "0.5": "50 %", "0.65": "65 %"}
ENGINE_SPARSITY = {"2:4": "2:4", "50%": "0.5", "65%": "0.65"}
QUALITY_MODEL = "smollm2-135m"
QUALITY_PROTOCOL = {"num_sequences": 32, "seq_len": 512, "eval_windows": 16}
METHODS = (  # (method, its baseline)
    ("whisper", "sparsegpt"),
    ("wisp", "wanda"),
)
NAMES = {"whisper": "Whisper", "sparsegpt": "SparseGPT", "wisp": "Wisp", "wanda": "Wanda"}
WORKLOADS = (
    ("decode, batch 1", ("decode:1x64",)),
    ("decode, batch 16", ("decode:16x64",)),
    ("prefill, 512-token prompts", ("prefill:4x512", "prefill:1x512")),
)
SIZE_RECIPES = {"2:4": "whisper_2of4", "0.5": "whisper_50", "0.65": "whisper_65"}


@functools.cache
def journal_entries() -> dict[str, tuple[int, str]]:
    """Each result file's place in the journal (0: named by its newest entry) and that
    entry's date."""
    journal = RESULTS / "JOURNAL.md"
    entries: dict[str, tuple[int, str]] = {}
    date = ""
    for line in journal.read_text().splitlines() if journal.exists() else []:
        heading = re.match(r"## (\d{4}-\d\d-\d\d)", line)
        date = heading.group(1) if heading else date
        for link in re.findall(r"\]\(([^)]+)\)", line):
            entries.setdefault(link, (len(entries), date))
    return entries


def file_date(path: Path, payload: dict, journal: dict[str, tuple[int, str]]) -> str:
    """The day a result was measured (``YYYY-MM-DD``): its JSON's, its report's, or else
    the day of the journal entry that wrote it."""
    if isinstance(payload.get("date"), str):
        return payload["date"][:10]
    report = path.with_suffix(".md")
    found = re.search(r"Generated (\d{4}-\d\d-\d\d)", report.read_text() if report.exists() else "")
    if found:
        return found.group(1)
    return journal.get(path.relative_to(RESULTS).as_posix(), (0, ""))[1]


def newest_first(paths: list[Path]) -> list[tuple[Path, dict, str]]:
    """``(path, payload, date)`` of each JSON file, the newest first."""
    journal = journal_entries()
    rows = []
    for path in paths:
        payload = json.loads(path.read_text())
        rows.append((path, payload, file_date(path, payload, journal)))

    def key(row):
        place = journal.get(row[0].relative_to(RESULTS).as_posix(), (len(journal), ""))[0]
        return (row[2], -place, str(row[0]))

    return sorted(rows, key=key, reverse=True)


def cpu_kind(cpu: str) -> str | None:
    """The CPU kind a result's ``cpu`` line names, or None for capped or unknown kernels."""
    if not cpu or "capped" in cpu or "emulated" in cpu:
        return None
    flags = cpu.split("(", 1)[-1]
    if re.search(r"(?<![-\w])amx_bf16", flags):
        return "AMX Xeon"
    kernels = re.search(r"op kernels (\w+)", cpu)
    kernels = kernels.group(1) if kernels else ""
    return {
        "avx512_bf16": "AVX-512 BF16 (Zen 5 EPYC)",
        "avx512": "AVX-512 EPYC",
        "avx2": "AVX2 EPYC",
    }.get(kernels)


def quality_cells() -> tuple[list[tuple[str, list[str]]], list[tuple[Path, str]], float | None]:
    """The perplexity rows, the files they came from, and the dense perplexity."""
    files = [p for p in RESULTS.rglob("quality.json") if "ablation" not in p.parts]
    latest: dict[tuple[str, str], tuple[dict, Path, str]] = {}
    dense = None
    for path, payload, date in newest_first(files):
        model = payload.get("models", {}).get(QUALITY_MODEL)
        if not model or any(model["spec"].get(k) != v for k, v in QUALITY_PROTOCOL.items()):
            continue
        dense = dense if dense is not None else model.get("dense")
        for sparsity, methods in model["runs"].items():
            for method, run in methods.items():
                if ":" in method or len(run.get("runs", [])) < 3:
                    continue
                latest.setdefault((method, sparsity), (run, path, date))
    rows, used = [], {}
    for method, baseline in METHODS:
        for name in (method, baseline):
            cells = []
            for sparsity in SPARSITIES:
                found = latest.get((name, sparsity))
                if found is None:
                    cells.append("–")
                    continue
                run, path, date = found
                used[path] = date
                cells.append(perplexity_cell(run, latest.get((baseline, sparsity)), name == method))
            label = f"perplexity, {NAMES[name]}" + ("" if name == method else " (its baseline)")
            rows.append((label, cells))
    return rows, sorted(used.items()), dense


def perplexity_cell(run: dict, baseline: tuple | None, is_method: bool) -> str:
    worst = max(seed["perplexity"] for seed in run["runs"])
    cell = f"{run['perplexity']:.2f} ± {run['perplexity_sem']:.2f} (worst {worst:.2f})"
    if is_method and baseline is not None and run["perplexity"] > baseline[0]["perplexity"]:
        cell += ", **worse than its baseline**"
    return cell


def size_cells() -> tuple[list[str], Path, str, int] | None:
    """The checkpoint sizes (MiB against the source) from the latest serving run."""
    path = RESULTS / "serving.json"
    if not path.exists():
        return None
    payload = json.loads(path.read_text())
    source = payload["source_bytes"]
    cells, dates = [], []
    for sparsity in SPARSITIES:
        sizes = [
            (run.get("date", ""), run["recipes"][SIZE_RECIPES[sparsity]]["bytes"])
            for run in payload["runs"].values()
            if SIZE_RECIPES[sparsity] in run["recipes"]
        ]
        if not sizes:
            cells.append("–")
            continue
        date, size = max(sizes)
        dates.append(date)
        cells.append(f"{size / 2**20:.0f} MiB ({size / source:.2f}×)")
    return cells, path, max(dates, default=""), source


def engine_ratio(payload: dict, sparsity: str, workloads: tuple[str, ...]) -> float | None:
    """The ratio to dense of ``sparsity``'s engine in kernel mode auto, or None."""
    if "results" in payload and "runs" in payload:  # vllm_paired.py
        for label, result in payload["results"].items():
            if ENGINE_SPARSITY.get(label) == sparsity and payload["config"].get("mode") == "auto":
                for workload in workloads:
                    if workload in result.get("workloads", {}):
                        return result["workloads"][workload].get("ratio")
        return None
    for label, engine in payload.get("engines", {}).items():  # vllm_speed.py
        name = label.split("@")[0].split()
        if len(name) == 2 and ENGINE_SPARSITY.get(name[0]) == sparsity and name[1] == "auto":
            for workload in workloads:
                if workload in engine.get("workloads", {}):
                    return engine["workloads"][workload].get("ratio")
    return None


def model_name(payload: dict) -> str:
    config = payload.get("config", {})
    return f"{config.get('shape', '?').upper()}-shaped, {config.get('layers', '?')} layers"


def speed_rows() -> tuple[list[tuple[str, list[str]]], list[tuple[Path, str, str]]]:
    """Per CPU kind, the vLLM rows: each sparsity from the latest file that served it."""
    files = [
        p
        for p in RESULTS.glob("cpu_vllm_speed*/*.json")
        if p.name.startswith(("vllm_paired", "vllm_speed"))
    ]
    chosen: dict[str, dict[str, tuple[Path, dict, str]]] = {}
    for path, payload, date in newest_first(files):
        kind = cpu_kind(payload.get("cpu", ""))
        if kind is None:
            continue
        for sparsity in SPARSITIES:
            if engine_ratio(payload, sparsity, WORKLOADS[0][1]) is not None:
                chosen.setdefault(kind, {}).setdefault(sparsity, (path, payload, date))
    rows, used = [], {}
    for kind in sorted(chosen):
        for label, workloads in WORKLOADS:
            cells = []
            for sparsity in SPARSITIES:
                found = chosen[kind].get(sparsity)
                ratio = None if found is None else engine_ratio(found[1], sparsity, workloads)
                cells.append("–" if ratio is None else ratio_cell(ratio))
                if ratio is not None:
                    used[found[0]] = (found[2], kind, model_name(found[1]))
            rows.append((f"vLLM {label}, {kind}", cells))
    return rows, sorted((path, *info) for path, info in used.items())


def ratio_cell(ratio: float) -> str:
    return f"**{ratio:.2f}×**" if ratio >= 1.0 else f"{ratio:.2f}×, **slower than dense**"


def op_only_kinds(measured: set[str]) -> list[tuple[str, Path, str]]:
    """CPU kinds with op-level results but no vLLM one: the kind and its latest op file."""
    files = list((RESULTS / "cpu_sparse24").glob("*.json"))
    found: dict[str, tuple[Path, str]] = {}
    for path, payload, date in newest_first(files):
        kind = cpu_kind(payload.get("cpu", ""))
        if kind and kind not in measured:
            found.setdefault(kind, (path, date))
    return [(kind, *found[kind]) for kind in sorted(found)]


def table() -> str:
    quality, quality_files, dense = quality_cells()
    sizes = size_cells()
    speed, speed_files = speed_rows()
    head = "| SmolLM2-135M and vLLM | " + " | ".join(SPARSITIES.values()) + " |"
    lines = [head, "|---" * (len(SPARSITIES) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in quality]
    if sizes:
        lines.append(
            f"| checkpoint, Whisper (dense {sizes[3] / 2**20:.0f} MiB) | "
            + " | ".join(sizes[0])
            + " |"
        )
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in speed]
    lines.append("")
    note = "Perplexity on WikiText-2 test (16 windows of 1024 tokens"
    note += f", dense {dense:.2f})" if dense else ")"
    note += ", 32 × 512 calibration tokens, 3 or more seeds; vLLM: tokens/s against dense bf16"
    lines.append(note + " on 2 cores, kernel mode `auto`. From:")
    rel = lambda p: p.relative_to(RESULTS.parent.parent).as_posix()  # noqa: E731
    for path, date in quality_files:
        lines.append(f"- perplexity: `{rel(path)}` ({date})")
    if sizes:
        lines.append(f"- size: `{rel(sizes[1])}` ({sizes[2]})")
    for path, date, kind, model in speed_files:
        how = (
            "engines held open, median of per-round ratios"
            if path.name.startswith("vllm_paired")
            else "one engine at a time, best of its runs"
        )
        lines.append(f"- {kind}: `{rel(path)}` ({date}; {model}; {how})")
    for kind, path, date in op_only_kinds({kind for _, _, kind, _ in speed_files}):
        lines.append(
            f"- {kind}: no vLLM end-to-end result yet; op level only, `{rel(path)}` ({date})"
        )
    return "\n".join(lines)


def with_table(readme: str, text: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"the README has no {BEGIN} … {END} markers")
    before, rest = readme.split(BEGIN, 1)
    return before + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, help="replace the table in this README")
    action.add_argument("--check", type=Path, help="exit 1 where this README's table differs")
    args = parser.parse_args(argv)
    text = table()
    if args.write:
        args.write.write_text(with_table(args.write.read_text(), text))
    elif args.check:
        readme = args.check.read_text()
        if with_table(readme, text) != readme:
            print(
                f"{args.check}'s results table is not benchmarks/summary.py's: run --write",
                file=sys.stderr,
            )
            return 1
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
