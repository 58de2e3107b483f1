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
    from whisper_modifiers.serving import (
        ServingUnavailable,
        run_vllm,
        scores_perplexity,
        serving_dtype,
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
        needed = serving_dtype(directory)
    except ServingUnavailable as error:  # this CPU's vLLM build lacks the scheme's kernels
        return row | {"served": False, "vllm_dtype": "–", "error": str(error).split(";")[0]}
    row["vllm_dtype"] = "float32" if needed == "auto" else needed
    start = time.perf_counter()
    try:
        served = run_vllm(directory, prompts=prompts, score=windows, max_tokens=max_tokens,
                          dtype=row["vllm_dtype"])  # fmt: skip
    except RuntimeError as error:
        errors = [line for line in str(error).splitlines() if "Error" in line]
        return row | {"served": False, "error": (errors or [str(error)])[-1].strip()}
    return row | {
        "served": True,
        "vllm_seconds": time.perf_counter() - start,
        "vllm_ppl": scores_perplexity(served["scores"]),
        "equal_greedy_prompts": sum(
            a == b for a, b in zip(served["completions"], reference, strict=True)
        ),  # fmt: skip
        "prompts": len(prompts),
        "sample": {"prompt": PROMPTS[0], "completion": tokenizer.decode(served["completions"][0])},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_checkpoint_arguments(parser, RECIPES)
    parser.add_argument("--eval-seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    quiet_logs()

    source, tokenizer, calibration, evaluation, ids = wikitext_setup(args.model)
    from whisper_modifiers.evaluation import evaluation_windows

    windows = evaluation_windows(ids, args.eval_seq_len, args.eval_windows)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            out = whisper_prune_to(Path(tmp) / recipe, recipe, args.model, calibration,
                                   evaluation, args.num_sequences, args.seq_len,
                                   "--eval-seq-len", str(args.eval_seq_len))  # fmt: skip
            rows[recipe] = measure(out, tokenizer, windows, args.max_tokens)
            print(recipe, rows[recipe], flush=True)
    report = {
        "config": vars(args) | {"out": str(args.out), "model": str(source)},
        "source_bytes": checkpoint_bytes(source),
        "recipes": rows,
    }
    write_json(args.out / "serving.json", report)
    (args.out / "serving.md").write_text(markdown(report, args))
    print(markdown(report, args))
    return 0


def markdown(report, args) -> str:
    mib = 2**20
    lines = [
        "# Serving benchmark",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/serving.py` on "
        f"`{Path(report['config']['model']).name}`: calibration {args.num_sequences} × "
        f"{args.seq_len} tokens; perplexity on the first {args.eval_windows} "
        f"{args.eval_seq_len}-token windows of WikiText-2 test, by transformers (weights "
        f"dequantized) and by vLLM (`prompt_logprobs`); greedy tokens compared on "
        f"{len(PROMPTS)} prompts × {args.max_tokens} tokens. The source model's weights take "
        f"{report['source_bytes'] / mib:.0f} MiB.",
        "",
        "| recipe | size (MiB) | vs source | vLLM (CPU) | vLLM dtype | ppl transformers "
        "| ppl vLLM | greedy tokens equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for recipe, r in report["recipes"].items():
        served = "serves" if r["served"] else f"fails: {r['error']}"
        lines.append(
            f"| {recipe} | {r['bytes'] / mib:.0f} | {r['bytes'] / report['source_bytes']:.2f}× | "
            f"{served} | {r['vllm_dtype']} | {r['transformers_ppl']:.2f} | "
            + (
                f"{r['vllm_ppl']:.2f} | {r['equal_greedy_prompts']}/{r['prompts']} |"
                if r["served"]
                else "– | – |"
            )
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
