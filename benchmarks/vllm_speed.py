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
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, check_serving_sparsities  # noqa: E402
from cpu_layers import cpu_line  # noqa: E402
from pruned_models import (  # noqa: E402
    LLAMA_SIZES,
    decoder_linear_names,
    prune_unstructured,
    pruned_llama,
)
from vllm_engine import DEFAULT_WORKLOADS, check_workloads  # noqa: E402
from vllm_speed_report import sparsity_label, write_report  # noqa: E402

from whisper_sparse.mode import KERNEL_MODES  # noqa: E402

ENGINE = Path(__file__).with_name("vllm_engine.py")
ENGINE_TIMEOUT = 900  # seconds: start (compile and graph capture) and every workload


def build_checkpoints(
    root: Path, shape: str, layers: int, dtype: str, sparsities: list[str]
) -> dict[str, Path]:
    """The dense checkpoint (a random model pruned 2:4 by magnitude, zeros stored) and, per
    sparsity, the compressed one: ``2:4`` that model in the 2:4 layout; an unstructured
    sparsity the same model with new random values pruned by magnitude, layer by layer, in
    the bitmask layout. Keyed ``dense`` and by ``sparsity_label``."""
    import torch

    from whisper_sparse.format.layout import write_compressed

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
                    weight.copy_(
                        prune_unstructured(torch.randn_like(weight) * 0.02, float(sparsity))
                    )
        model.save_pretrained(paths[label])
        write_compressed(paths[label], *((targets, []) if sparsity == "2:4" else ([], targets)))
    return paths


def engine_command(
    python: str, checkpoint: Path, label: str, mode: str, capture: int, args, out: Path
) -> list[str]:
    command = [
        python,
        str(ENGINE),
        str(checkpoint),
        "--label",
        label,
        "--mode",
        mode,
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
        "--out",
        str(out),
        "--workloads",
        *args.workloads,
    ]
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
    from whisper_sparse.driver.worker_process import exit_description, last_lines, serving_env

    print("+ " + " ".join(command), flush=True)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=serving_env()
        )
    except subprocess.TimeoutExpired as expired:
        return {
            "error": f"stopped after {timeout:.0f} s",
            "tail": last_lines(expired.stdout, expired.stderr),
        }
    if done.returncode != 0 or not out.is_file():
        return {
            "error": exit_description(done.returncode),
            "tail": last_lines(done.stdout, done.stderr),
        }
    return json.loads(out.read_text())


def compare(args, python: str, payload: dict) -> None:
    """Run every engine ``args.rounds`` times, in turn, into ``payload["engines"]`` (keyed
    ``label@capture``, each with its ``rounds``), writing the report after each engine, so
    that a run stopped at a time limit keeps what ran before."""
    engines = payload["engines"]
    with tempfile.TemporaryDirectory() as root:
        paths = build_checkpoints(Path(root), args.shape, args.layers, args.dtype, args.sparsity)
        for capture in args.capture_sizes:
            runs = [("dense", paths["dense"], "auto")] + [
                (f"{label} {mode}", path, mode)
                for label, path in paths.items()
                if label != "dense"
                for mode in args.modes
            ]
            for _ in range(args.rounds):
                for label, checkpoint, mode in runs:
                    out = Path(root, f"{label.replace(' ', '-')}-{capture}.json")
                    command = engine_command(python, checkpoint, label, mode, capture, args, out)
                    entry = engines.setdefault(f"{label}@{capture}", {"rounds": []})
                    entry["rounds"].append(run_engine(command, out, args.timeout))
                    write_report(args.out, payload)


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
    from whisper_sparse.driver.worker_process import serving_python

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
