"""vLLM correctness of the compressed 2:4 path: each checkpoint served by vLLM from its
compressed layout (through the plugin, with the sparse kernels where the device has them)
against the same weights served dense by vLLM (``write_dense_layout``: what stock vLLM
loads, through compressed-tensors for a quantized chain).

    python benchmarks/vllm_correctness.py               # SmolLM2-135M, Whisper 2:4, W8A8, FP8
    python benchmarks/vllm_correctness.py --dtype bfloat16  # on a GPU: cuSPARSELt vs dense
    python benchmarks/vllm_correctness.py --checkpoints DIR ...  # already written ones

For every checkpoint: greedy tokens of ``--prompts`` WikiText-2 test prompts (``--max-tokens``
generated), and the per-token prompt log-probabilities of the same windows. Reported: the
prompts whose greedy tokens are all equal, the first position where any differs, and the
largest and mean absolute log-probability difference. Writes ``vllm_correctness.md`` and
``.json`` to ``--out``. Needs the serving environment (scripts/setup_serving.sh).
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

RECIPES = ["whisper_2of4", "whisper_2of4_w8a8", "whisper_2of4_fp8"]


def compare(ours: dict, dense: dict) -> dict:
    """Greedy tokens and prompt log-probabilities of two ``run_vllm`` answers."""
    pairs = list(zip(ours["completions"], dense["completions"], strict=True))
    diverged = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in pairs
    ]
    deltas = [
        abs(a - b)
        for x, y in zip(ours["scores"], dense["scores"], strict=True)
        for a, b in zip(x["logprobs"], y["logprobs"], strict=True)
    ]
    return {
        "equal_prompts": sum(d is None for d in diverged),
        "prompts": len(pairs),
        "first_difference": min((d for d in diverged if d is not None), default=None),
        "max_abs_logprob_difference": max(deltas),
        "mean_abs_logprob_difference": sum(deltas) / len(deltas),
        "scored_tokens": len(deltas),
    }


def measure(
    checkpoint: Path, prompts, windows, max_tokens: int, dtype: str | None, timeout: float
) -> dict:
    from whisper_sparse.driver import run_vllm, serving_dtype
    from whisper_sparse.format.layout import write_dense_layout

    dtype = dtype or serving_dtype(checkpoint)
    run = {
        "prompts": prompts,
        "score": windows,
        "max_tokens": max_tokens,
        "dtype": dtype,
        "timeout": timeout,
    }
    ours = run_vllm(checkpoint, **run)
    with tempfile.TemporaryDirectory() as tmp:
        dense = run_vllm(write_dense_layout(checkpoint, Path(tmp) / "dense"), **run)
    return {"dtype": dtype} | compare(ours, dense)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_checkpoint_arguments(parser, RECIPES)
    parser.add_argument(
        "--checkpoints",
        nargs="+",
        type=Path,
        default=None,
        help="compressed checkpoints to compare instead of pruning",
    )
    parser.add_argument("--dtype", default=None, help="default: serving.serving_dtype's")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--timeout",
        type=float,
        default=1200,
        help="seconds one vLLM run may take before it is stopped",
    )
    args = parser.parse_args(argv)
    quiet_logs()

    source, _, calibration, evaluation, ids = wikitext_setup(args.model)
    from whisper_modifiers.evaluation import evaluation_windows

    windows = [w.tolist() for w in evaluation_windows(ids, args.prompt_len, args.prompts)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {str(path): path for path in args.checkpoints or []}
        for recipe in [] if args.checkpoints else args.recipes:
            checkpoints[recipe] = whisper_prune_to(
                Path(tmp) / recipe,
                recipe,
                args.model,
                calibration,
                evaluation,
                args.num_sequences,
                args.seq_len,
                "--layout",
                "compressed",
            )
        for name, checkpoint in checkpoints.items():
            rows[name] = measure(
                checkpoint, windows, windows, args.max_tokens, args.dtype, args.timeout
            )
            print(name, rows[name], flush=True)
    report = {
        "config": vars(args)
        | {
            "out": str(args.out),
            "model": str(source),
            "checkpoints": [str(p) for p in args.checkpoints or []],
        },
        "rows": rows,
    }
    write_json(args.out / "vllm_correctness.json", report)
    (args.out / "vllm_correctness.md").write_text(markdown(report, args))
    print(markdown(report, args))
    return 0


def markdown(report, args) -> str:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        "# vLLM: compressed 2:4 checkpoint against the same weights served dense",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/vllm_correctness.py` on "
        f"{device}: {args.prompts} WikiText-2 test prompts of {args.prompt_len} tokens, "
        f"{args.max_tokens} greedy tokens each, and the per-token prompt log-probabilities "
        "of the same windows.",
        "",
        "| checkpoint | dtype | prompts with equal greedy tokens | first difference at "
        "| max \\|Δ log p\\| | mean \\|Δ log p\\| |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in report["rows"].items():
        first = "–" if r["first_difference"] is None else f"token {r['first_difference']}"
        lines.append(
            f"| {name} | {r['dtype']} | {r['equal_prompts']}/{r['prompts']} | {first} | "
            f"{r['max_abs_logprob_difference']:.2e} | {r['mean_abs_logprob_difference']:.2e} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
