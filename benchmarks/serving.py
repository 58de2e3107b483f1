"""Serving benchmark: which pruned (and quantized) checkpoints vLLM serves, their sizes,
and how close vLLM's outputs are to transformers' on the same checkpoint.

    python benchmarks/serving.py                    # SmolLM2-135M, Whisper 2:4 (+ W8A8/FP8/W4A16)
    python benchmarks/serving.py --recipes wisp_plus_2of4_w8a8 --model meta-llama/Llama-3.2-1B

Each recipe is run by ``whisper-prune`` into a temporary directory, then measured: the
checkpoint's size, WikiText-2 perplexity in transformers (weights dequantized) and in vLLM
(``prompt_logprobs``) on the same windows, and whether vLLM's greedy tokens equal
transformers' for a few prompts. Needs the serving environment (scripts/setup_serving.sh).
Writes ``serving.md`` and ``serving.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_checkpoint_arguments,
    quiet_logs,
    whisper_prune_to,
    wikitext_setup,
    write_json,
)

CPU_KINDS = ("AVX2 only", "AVX-512", "AVX-512/AMX")  # how cpu_kind() names them
EMULATED_LIMIT = 900  # seconds for vLLM's emulated FP8 run; on AMX it did not finish in 1200
RECIPES = ["whisper_2of4", "whisper_2of4_w8a8", "whisper_2of4_fp8", "whisper_2of4_w4a16"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was",
    "The theory of relativity states that",
]


def checkpoint_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def measure(directory: Path, tokenizer, windows, max_tokens: int) -> dict:
    import torch

    from whisper_modifiers.checkpoint import load_checkpoint
    from whisper_modifiers.evaluation import perplexity
    from whisper_sparse.driver import (
        ServingUnavailable,
        run_vllm,
        scores_perplexity,
        serving_plan,
    )

    model = load_checkpoint(directory).eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with torch.no_grad():
        reference_ppl = perplexity(model, torch.cat(windows), len(windows[0]), len(windows))
        reference = [
            model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)[
                0, len(ids) :
            ].tolist()
            for ids in prompts
        ]
    row = {"bytes": checkpoint_bytes(directory), "transformers_ppl": reference_ppl}
    try:  # float32 where vLLM has kernels for it, as transformers runs; else what vLLM needs
        plan = serving_plan(directory)
    except ServingUnavailable as error:  # this CPU's vLLM build lacks the scheme's kernels
        return row | {"served": False, "vllm_dtype": "–", "error": str(error).split(";")[0]}
    row["vllm_dtype"] = "float32" if takes_float32(directory, plan) else plan.resolved
    plan = serving_plan(directory, dtype=row["vllm_dtype"])
    start = time.perf_counter()
    try:
        served = run_vllm(
            directory,
            prompts=prompts,
            score=windows,
            max_tokens=max_tokens,
            dtype=row["vllm_dtype"],
        )
    except RuntimeError as error:  # WorkerFailed: how the worker ended and its last lines
        errors = [line for line in str(error).splitlines() if "Error" in line]
        return row | {"served": False, "error": (errors or [str(error)])[-1].strip()}
    generated = sum(len(tokens) for tokens in served["completions"])
    scored = sum(len(window) for window in windows)
    return row | {
        "served": True,
        "notes": list(plan.notes),
        "vllm_seconds": time.perf_counter() - start,
        "prefill_tokens_per_s": scored / served["seconds"]["score"],
        "decode_tokens_per_s": generated / served["seconds"]["generate"],
        "vllm_ppl": scores_perplexity(served["scores"]),
        "equal_greedy_prompts": sum(
            a == b for a, b in zip(served["completions"], reference, strict=True)
        ),
        "prompts": len(prompts),
        "sample": {"prompt": PROMPTS[0], "completion": tokenizer.decode(served["completions"][0])},
    }


def takes_float32(directory: Path, plan) -> bool:
    """Whether vLLM's kernels for this checkpoint run in float32 here (unquantized
    checkpoints do; a quantized one's are asked, as ``serving_plan`` asks them)."""
    from whisper_sparse.driver.probe import probe_dtypes
    from whisper_sparse.driver.worker_process import serving_python

    if plan.resolved is None:  # not quantized, or not on a CPU: vLLM's dense path
        return True
    config = json.loads((directory / "config.json").read_text())
    return probe_dtypes(directory, config, ["float32"], serving_python())["dtype"] == "float32"


def emulated_fp8_speed(directory: Path, tokenizer, windows, max_tokens: int, dtype: str) -> dict:
    """What vLLM alone does with an FP8 chain on a CPU whose FP8 path is its emulation:
    the chain's dense layout (which the plugin does not load) run by vLLM's own
    compressed-tensors kernels, bypassing ``serving_plan``'s refusal, bounded in time."""
    from whisper_sparse.driver.worker_process import WorkerFailed, run_worker, serving_python
    from whisper_sparse.format.layout import write_dense_layout

    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        dense = write_dense_layout(directory, Path(tmp) / "dense")
        request = {
            "model": str(dense),
            "dtype": dtype,
            "max_tokens": max_tokens,
            "max_model_len": max(len(w) for w in windows) + 1,
            "prompts": prompts,
            "score": [list(map(int, w)) for w in windows],
        }
        try:
            served = run_worker(request, serving_python(), EMULATED_LIMIT, "emulated FP8")
        except WorkerFailed as error:
            return {"served": False, "error": f"vLLM's emulated FP8 ({error.ending})"}
    return {
        "served": True,
        "vllm_dtype": dtype,
        "prefill_tokens_per_s": sum(map(len, windows)) / served["seconds"]["score"],
        "decode_tokens_per_s": sum(map(len, served["completions"])) / served["seconds"]["generate"],
    }


def cpu_kind() -> tuple[str, str]:
    """This CPU's kind (one of ``CPU_KINDS``) and how the serving table names it."""
    from whisper_sparse.cpu.cpu_info import cpu_flag_set, cpu_model

    flags = cpu_flag_set()
    if {"amx_int8", "amx_bf16"} <= flags:
        kind, detail = "AVX-512/AMX", ""
    elif "avx512f" in flags:
        kind, detail = "AVX-512", " VNNI" * ("avx512_vnni" in flags) + ", no AMX"
    else:
        kind, detail = "AVX2 only", ""
    return kind, f"{kind}{detail} ({cpu_model()}, {os.cpu_count()} cores)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_checkpoint_arguments(parser, RECIPES)
    parser.add_argument("--eval-seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--redraw",
        action="store_true",
        help="only write serving.md again from --out's serving.json",
    )
    args = parser.parse_args(argv)
    quiet_logs()
    if args.redraw:
        report = json.loads((args.out / "serving.json").read_text())
        (args.out / "serving.md").write_text(
            markdown(report, argparse.Namespace(**report["config"]))
        )
        return 0

    from whisper_sparse.driver.capabilities import capabilities

    source, tokenizer, calibration, evaluation, ids = wikitext_setup(args.model)
    from whisper_modifiers.evaluation import evaluation_windows

    windows = evaluation_windows(ids, args.eval_seq_len, args.eval_windows)
    emulated = capabilities()["fp8_dynamic_kernel"].endswith("(emulated)")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            out = whisper_prune_to(
                Path(tmp) / recipe,
                recipe,
                args.model,
                calibration,
                evaluation,
                args.num_sequences,
                args.seq_len,
                "--eval-seq-len",
                str(args.eval_seq_len),
            )
            rows[recipe] = measure(out, tokenizer, windows, args.max_tokens)
            print(recipe, rows[recipe], flush=True)
            if emulated and "fp8" in recipe and rows[recipe]["served"]:
                rows[recipe]["vllm_emulated_fp8"] = emulated_fp8_speed(
                    out, tokenizer, windows, args.max_tokens, rows[recipe]["vllm_dtype"]
                )
                print(recipe, "vLLM's emulated FP8:", rows[recipe]["vllm_emulated_fp8"])
    path = args.out / "serving.json"
    runs = previous_runs(path) if path.is_file() else {}
    kind, name = cpu_kind()  # this run's recipes replace their rows of an earlier run here
    earlier = runs.get(name, {}).get("recipes", {})
    for recipe in earlier:  # rows this run keeps say when they were measured
        earlier[recipe].setdefault("date", runs[name]["date"])
    today = time.strftime("%Y-%m-%d")
    rows = {recipe: row | {"date": today} for recipe, row in rows.items()}
    runs[name] = {"kind": kind, "date": today, "recipes": earlier | rows}
    report = {
        "config": vars(args) | {"out": str(args.out), "model": str(source)},
        "source_bytes": checkpoint_bytes(source),
        "runs": runs,
    }
    write_json(path, report)
    (args.out / "serving.md").write_text(markdown(report, args))
    print(markdown(report, args))
    return 0


def previous_runs(path: Path) -> dict:
    """The runs on other CPUs that ``path`` holds (one run of the older single-CPU shape,
    measured on an AVX2-only EPYC, comes in under that name)."""
    report = json.loads(path.read_text())
    if "runs" in report:
        return report["runs"]
    return {
        "AVX2 only (AMD EPYC, 2 cores)": {
            "kind": "AVX2 only",
            "date": "2026-11-23",
            "recipes": report["recipes"],
        }
    }


def markdown(report, args) -> str:
    mib = 2**20
    measured = {run["kind"] for run in report["runs"].values()}
    unmeasured = ", ".join(kind for kind in CPU_KINDS if kind not in measured) or "none"
    lines = [
        "# Serving benchmark",
        "",
        f"`benchmarks/serving.py` on `{Path(report['config']['model']).name}`, one run per "
        f"kind of CPU: calibration {args.num_sequences} × {args.seq_len} tokens; perplexity on "
        f"the first {args.eval_windows} {args.eval_seq_len}-token windows of WikiText-2 test, "
        "by transformers (`load_checkpoint`: weights dequantized, compressed-tensors' "
        "activation quantization) and by vLLM (`prompt_logprobs`); greedy tokens compared on "
        f"{len(PROMPTS)} prompts × {args.max_tokens} tokens. Throughput is vLLM's, in-process "
        f"on all cores: scoring (prefill with `prompt_logprobs`) of the {args.eval_windows} "
        f"windows at once, and greedy decoding of the {len(PROMPTS)} prompts at once. The "
        f"source model's weights take {report['source_bytes'] / mib:.0f} MiB. Not measured: "
        + unmeasured
        + ".",
        "",
        "| CPU | recipe | size (MiB) | vs source | vLLM | vLLM dtype | ppl transformers "
        "| ppl vLLM | greedy tokens equal | scoring tok/s | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cpu, run in report["runs"].items():
        for recipe, r in run["recipes"].items():
            date = r.get("date", run["date"])  # each row's own, where it has one
            lines.append(row_markdown(f"{cpu}, {date}", recipe, r, report["source_bytes"]))
            if "vllm_emulated_fp8" in r:
                emulated = r["vllm_emulated_fp8"] | {"bytes": None}  # not written here
                label = f"{recipe}, dense layout: vLLM's emulated FP8 alone"
                lines.append(row_markdown("", label, emulated, report["source_bytes"]))
    notes = {
        note
        for run in report["runs"].values()
        for r in run["recipes"].values()
        for note in r.get("notes", [])
    }
    lines += [""] + [f"- {note}." for note in sorted(notes)]
    return "\n".join(lines) + "\n"


def row_markdown(cpu: str, recipe: str, r: dict, source_bytes: int) -> str:
    mib = 2**20

    def number(key, digits):
        return f"{r[key]:.{digits}f}" if r.get(key) is not None else "–"

    served = "serves" if r["served"] else f"fails: {r['error']}"
    if r["served"] and r.get("notes"):
        served += " (FP8 weights dequantized by the plugin)"
    equal = f"{r['equal_greedy_prompts']}/{r['prompts']}" if "prompts" in r else "–"
    size = (
        "– | –"
        if r["bytes"] is None
        else (f"{r['bytes'] / mib:.0f} | {r['bytes'] / source_bytes:.2f}×")
    )
    return (
        f"| {cpu} | {recipe} | {size} | "
        f"{served} | {r.get('vllm_dtype', '–')} | {number('transformers_ppl', 2)} | "
        f"{number('vllm_ppl', 2)} | {equal} | {number('prefill_tokens_per_s', 0)} | "
        f"{number('decode_tokens_per_s', 1)} |"
    )


if __name__ == "__main__":
    sys.exit(main())
