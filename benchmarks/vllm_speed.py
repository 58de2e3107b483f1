"""vLLM serving speed of compressed sparse checkpoints (2:4, unstructured) against the same
model dense, with what the compressed layers hold for their weights and, with
``--profile``, where the time goes.

    python benchmarks/vllm_speed.py --layers 8 --profile            # GPU: Llama-7B-shaped
    python benchmarks/vllm_speed.py --modes auto sparse --capture-sizes 0 2048
    python benchmarks/vllm_speed.py --shape 1b --layers 12 --modes auto --sparsity 2:4 0.5 0.65
    python benchmarks/vllm_speed.py --shape tiny --dtype float32 --workloads decode:2x8

Builds a Llama-7B-shaped decoder of ``--layers`` layers with random weights (every decoder
Linear pruned 2:4 by magnitude; ``--shape tiny`` is a 2-layer, hidden-128 stand-in for a
CPU smoke run), saves it dense and, for each ``--sparsity``, compressed: ``2:4`` in the 2:4
layout, an unstructured sparsity (new random values pruned by magnitude, layer by layer) in
the bitmask layout. One engine per configuration runs, each in its own process
(``vllm_engine.py``, with the serving environment's Python): the dense checkpoint, then
each compressed one in each kernel ``--modes`` (``$WHISPER_MODIFIERS_SPARSE``: ``auto``
keeps the dense weight beside the compressed one on GPUs, ``sparse`` the compressed one
alone); each at each ``--capture-sizes`` (vLLM's ``max_cudagraph_capture_size``, 0 for
vLLM's default; without graphs, as vLLM runs by default: compiled by torch.compile on a
CPU, or eagerly with ``--enforce-eager``). The engines run ``--rounds`` times, in turn
(dense, 2:4, dense, 2:4, ...: on a shared machine one engine's speed moves from run to
run), and each workload's tokens/s is the median over the rounds of each engine's median
over its ``--repeats``.
Ratios are tokens/s over dense tokens/s at the same capture size: above 1 is faster. RSS
saved is the dense engine's resident memory after loading less this engine's, over the
dense bytes of the compressed layers' weights. Writes ``vllm_speed.md`` and
``vllm_speed.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, check_serving_sparsities, write_json  # noqa: E402
from cpu_sparse24 import cpu_line  # noqa: E402
from pruned_models import (  # noqa: E402
    LLAMA_SIZES,
    decoder_linear_names,
    prune_unstructured,
    pruned_llama,
)
from vllm_engine import DEFAULT_WORKLOADS, check_workloads  # noqa: E402

from whisper_modifiers.sparse_serving.mode import KERNEL_MODES  # noqa: E402

ENGINE = Path(__file__).with_name("vllm_engine.py")
ENGINE_TIMEOUT = 900  # seconds: start (compile and graph capture) and every workload
# resident memory after load, as it is and after the process's freed heap pages went back
RSS_FIELDS = ("rss_after_load", "rss_after_load_trimmed")


def sparsity_label(sparsity: str) -> str:
    """``2:4`` or an unstructured sparsity as a percentage (``0.65`` -> ``65%``)."""
    return sparsity if sparsity == "2:4" else f"{float(sparsity) * 100:g}%"


def build_checkpoints(root: Path, shape: str, layers: int, dtype: str,
                      sparsities: list[str]) -> dict[str, Path]:  # fmt: skip
    """The dense checkpoint (a random model pruned 2:4 by magnitude, zeros stored) and, per
    sparsity, the compressed one: ``2:4`` that model in the 2:4 layout; an unstructured
    sparsity the same model with new random values pruned by magnitude, layer by layer, in
    the bitmask layout. Keyed ``dense`` and by ``sparsity_label``."""
    import torch

    from whisper_modifiers.sparse_serving.format.layout import write_compressed

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = pruned_llama(layers, getattr(torch, dtype), shape, device)
    targets = decoder_linear_names(model)
    paths = {"dense": root / "dense"}
    model.save_pretrained(paths["dense"])
    for sparsity in sparsities:
        label = sparsity_label(sparsity)
        paths[label] = root / label.replace(":", "of").replace("%", "pct")
        if sparsity != "2:4":
            with torch.no_grad():
                for name in targets:
                    weight = model.get_submodule(name).weight
                    weight.copy_(prune_unstructured(torch.randn_like(weight) * 0.02,
                                                    float(sparsity)))  # fmt: skip
        model.save_pretrained(paths[label])
        write_compressed(paths[label], *((targets, []) if sparsity == "2:4" else ([], targets)))
    return paths


def engine_command(python: str, checkpoint: Path, label: str, mode: str, capture: int,
                   args, out: Path) -> list[str]:  # fmt: skip
    command = [python, str(ENGINE), str(checkpoint), "--label", label, "--mode", mode,
               "--dtype", args.dtype, "--repeats", str(args.repeats), "--out", str(out),
               "--workloads", *args.workloads]  # fmt: skip
    if capture:
        command += ["--max-cudagraph-capture-size", str(capture)]
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.profile:
        command.append("--profile")
    if args.enforce_eager:
        command.append("--enforce-eager")
    return command


def run_engine(command: list[str], out: Path, timeout: float) -> dict:
    """One engine's result, or ``{"error": ...}`` with how it ended and its last lines."""
    from whisper_modifiers.serving.worker_process import exit_description, last_lines, serving_env

    print("+ " + " ".join(command), flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=serving_env())  # fmt: skip
    except subprocess.TimeoutExpired as expired:
        return {"error": f"stopped after {timeout:.0f} s",
                "tail": last_lines(expired.stdout, expired.stderr)}  # fmt: skip
    if done.returncode != 0 or not out.is_file():
        return {"error": exit_description(done.returncode),
                "tail": last_lines(done.stdout, done.stderr)}  # fmt: skip
    return json.loads(out.read_text())


def compare(args, python: str, payload: dict) -> None:
    """Run every engine ``args.rounds`` times, in turn, into ``payload["engines"]`` (keyed
    ``label@capture``, each with its ``rounds``), writing the report after each engine, so
    that a run stopped at a time limit keeps what ran before."""
    engines = payload["engines"]
    with tempfile.TemporaryDirectory() as root:
        paths = build_checkpoints(Path(root), args.shape, args.layers, args.dtype,
                                  args.sparsity)  # fmt: skip
        for capture in args.capture_sizes:
            runs = [("dense", paths["dense"], "auto")] + [
                (f"{label} {mode}", path, mode)
                for label, path in paths.items() if label != "dense" for mode in args.modes
            ]  # fmt: skip
            for _ in range(args.rounds):
                for label, checkpoint, mode in runs:
                    out = Path(root, f"{label.replace(' ', '-')}-{capture}.json")
                    command = engine_command(python, checkpoint, label, mode, capture, args, out)
                    entry = engines.setdefault(f"{label}@{capture}", {"rounds": []})
                    entry["rounds"].append(run_engine(command, out, args.timeout))
                    write_report(args.out, payload)


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
        result["workloads"][workload] = {"tokens_per_s": statistics.median(rates),
                                         "rounds": rates}  # fmt: skip
    return result


def with_ratios(results: dict) -> None:
    """Each workload's tokens/s over dense's at the same capture size (None without it),
    and the resident memory saved against dense over the 2:4 layers' dense weight bytes."""
    for key, result in results.items():
        dense = results.get(f"dense@{key.rsplit('@', 1)[1]}", {})
        for workload, cell in result.get("workloads", {}).items():
            base = dense.get("workloads", {}).get(workload)
            cell["ratio"] = cell["tokens_per_s"] / base["tokens_per_s"] if base else None
        dense_bytes = result.get("weights", {}).get("dense_bytes")
        for field, saved in zip(RSS_FIELDS, ("rss_saved", "rss_saved_trimmed"), strict=True):
            result[saved] = ((dense[field] - result[field]) / dense_bytes
                             if dense.get(field) and result.get(field) and dense_bytes
                             else None)  # fmt: skip


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
            lines.append(f"| {label} | {capture} | failed: {result['error']} | | | |"
                         + " |" * len(workloads))  # fmt: skip
            continue
        ratio = result["weights"].get("ratio")
        cells = []
        for workload in workloads:
            cell = result["workloads"][workload]
            rate = f"{cell['tokens_per_s']:,.0f}"
            cells.append(rate if cell["ratio"] is None or label == "dense"
                         else f"{rate} ({cell['ratio']:.2f}×)")  # fmt: skip
        weights = f"{ratio:.2f}×" if ratio is not None else "–"
        if result["weights"].get("packed_layers"):
            weights = "packed by vLLM's CPU GEMM"
        graphs = result["graphs"]
        compiled = graphs.get("compilation_mode", "NONE") != "NONE"
        steps = (f"{graphs['max_cudagraph_capture_size'] or ('compiled' if compiled else 'eager')}"
                 f" / {graphs['max_num_batched_tokens']}")  # fmt: skip
        rss = result.get("rss_after_load")
        rss = "–" if rss is None else f"{rss / 2**30:.2f}"
        saved = " | ".join("–" if result.get(key) is None else f"{result[key]:.2f}×"
                           for key in ("rss_saved", "rss_saved_trimmed"))  # fmt: skip
        lines.append(f"| {label} | {capture} | {steps} | {weights} | {rss} | {saved} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    lines += profile_markdown(engines)
    return "\n".join(lines) + "\n"


def profile_markdown(engines: dict) -> list[str]:
    lines = []
    for key, result in engines.items():
        for workload, profile in result.get("profiles", {}).items():
            lines += ["", f"## Profile: {key}, {workload}", "",
                      "| op | calls | self CPU (ms) | self device (ms) |",
                      "|---|---|---|---|"]  # fmt: skip
            for row in profile["top"]:
                cpu_ms, device_ms = row["self_cpu_us"] / 1e3, row["self_device_us"] / 1e3
                lines.append(f"| `{row['op'][:80]}` | {row['calls']} | {cpu_ms:.2f} | "
                             f"{device_ms:.2f} |")  # fmt: skip
            for name, entry in profile["watched"].items():
                per_call = entry["cpu_us_per_call"]
                per_call = "-" if per_call is None else f"{per_call:.1f}"
                lines += ["", f"`{name}`: {entry['calls']} calls, {per_call} µs CPU per call"]
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="7b", choices=list(LLAMA_SIZES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--modes", nargs="+", default=["auto", "sparse"], choices=KERNEL_MODES)
    parser.add_argument(
        "--sparsity",
        nargs="+",
        default=["2:4"],
        help="the compressed checkpoints: 2:4 and/or unstructured sparsities in (0, 1)",
    )
    parser.add_argument("--capture-sizes", nargs="+", type=int, default=[0])
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="times every engine runs, the engines in turn (medians)",
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the engines eagerly (default: as vLLM does, CUDA graphs on a GPU and the "
        "model compiled by torch.compile on a CPU)",
    )
    parser.add_argument("--timeout", type=float, default=ENGINE_TIMEOUT)
    parser.add_argument("--python", default=None, help="the serving environment's Python")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    check_workloads(parser, args.workloads)
    check_serving_sparsities(parser, args.sparsity)
    if args.layers < 1 or args.repeats < 1 or args.rounds < 1 or min(args.capture_sizes) < 0:
        parser.error(
            "--layers, --repeats and --rounds must be at least 1, --capture-sizes at least 0"
        )
    return args


def main(argv=None) -> int:
    from whisper_modifiers.serving.worker_process import serving_python

    args = parse_args(argv)
    python = str(serving_python(args.python))
    payload = {
        "config": vars(args) | {"out": str(args.out), "python": python},
        "cpu": cpu_line(),
        "engines": {},
    }
    compare(args, python, payload)
    print(write_report(args.out, payload))
    return 0 if all("error" not in e for e in payload["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
