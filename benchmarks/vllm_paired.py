"""vLLM serving speed of compressed checkpoints against dense, their engines held open side by
side and timed in turn, seconds apart.

    python benchmarks/vllm_paired.py --shape 7b --layers 8 --sparsity 0.5 0.65 --enforce-eager
    python benchmarks/vllm_paired.py --shape tiny --dtype float32 --rounds 2 --settle 0
    python benchmarks/vllm_paired.py --shape 7b --sparsity 2:4 0.65 --quantize w8a8 --enforce-eager

Builds the checkpoints as ``vllm_speed.py`` does (dense, and one compressed per
``--sparsity``; with ``--quantize w8a8``, ``w8a8_checkpoints.py``'s: those pruned and
quantized W8A8 in one llmcompressor recipe, and dense W8A8 beside dense bf16), starts one
engine per checkpoint (``vllm_held_engine.py`` with the serving environment's Python, in
kernel mode ``--mode``; dense W8A8 in ``dense``), all resident at once, and times each
workload on them in turn for ``--rounds`` rounds, ``--settle`` seconds apart (an idle
engine's OpenMP threads stop spinning). Each round runs one of ``common.balanced_orders``
and then that order reversed (dense, 50 %, 65 %, 65 %, 50 %, dense in the first round; 50 %,
65 %, dense, dense, 65 %, 50 % in the next ...): within a round each engine's mean place is
the same, and over a cycle of rounds each engine starts, ends and follows every other
engine equally often (a fixed order put identical weights 3-13 % apart by their place at
the op level). On a shared host the memory speed moves within seconds: ``vllm_speed.py``
starts each engine anew, so its engines run minutes apart and may draw different phases;
here runs of a round are seconds apart.
In each round an engine's rate is its two runs' tokens over their seconds, and its ratio
that rate over dense's in the same round (and over dense W8A8's, where it runs); the report
gives each engine's median rate, and the median, lowest and highest of its ratios over the
rounds, with every round's values. RSS saved is as in ``vllm_speed.py`` (each engine's own
process; against dense W8A8 too, where it runs). On a GPU the engines share
``GPU_MEMORY`` of its memory. Writes ``--name``.md and ``--name``.json to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, balanced_orders, check_serving_sparsities, run_stamp, write_json  # noqa: E402
from cpu_layers import cpu_line  # noqa: E402
from pruned_models import LLAMA_SIZES  # noqa: E402
from vllm_engine import Workload, check_workloads  # noqa: E402
from vllm_paired_report import markdown, summarise  # noqa: E402
from vllm_speed import build_checkpoints  # noqa: E402
from w8a8_checkpoints import build_w8a8_checkpoints  # noqa: E402

from whisper_sparse.heap import release_freed_heap  # noqa: E402
from whisper_sparse.mode import KERNEL_MODES  # noqa: E402

HELD_ENGINE = Path(__file__).with_name("vllm_held_engine.py")
GPU_MEMORY = 0.85  # of a GPU's memory, shared by the engines held on it


class HeldEngine:
    """One ``vllm_held_engine.py`` process: ``ask`` sends it a command and returns its JSON
    answer, or raises ``WorkerFailed`` (a ``RuntimeError``) with how it ended and its last
    lines."""

    def __init__(self, command: list[str], label: str, log: Path, timeout: float):
        from whisper_sparse.driver.worker_process import serving_env

        self.label, self.log, self.timeout = label, log, timeout
        read, write = os.pipe()
        with open(log, "w") as output:
            self.process = subprocess.Popen(
                [command[0], str(HELD_ENGINE), str(write), *command[1:]],
                stdin=subprocess.PIPE,
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
                env=serving_env(),
                pass_fds=[write],
            )
        os.close(write)
        self.control = os.fdopen(read)
        self.loaded = self.answer()

    def answer(self) -> dict:
        from whisper_sparse.driver.worker_process import WorkerFailed, control_line, last_lines

        line, ending = control_line(self.control, self.process, self.timeout)
        if line:
            return json.loads(line)
        tail = last_lines(self.log.read_text(errors="replace"))
        raise WorkerFailed(f"the {self.label} engine gave no answer", ending, tail)

    def ask(self, command: str) -> dict:
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it ended: answer() says how
        return self.answer()

    def close(self) -> dict:
        """Its input closed, its last answer (peak resident memory); killed if it hangs."""
        try:
            self.process.stdin.close()
            return self.answer()
        except (RuntimeError, BrokenPipeError):
            return {}
        finally:
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def engine_command(
    python: str, checkpoint: Path, label: str, mode: str, engines: int, args
) -> list[str]:
    """One engine's command; on a GPU the engines share its memory (``GPU_MEMORY`` of it)."""
    command = [
        python,
        str(checkpoint),
        "--label",
        label,
        "--mode",
        mode,
        "--dtype",
        args.dtype,
        "--workloads",
        *args.workloads,
        "--gpu-memory-utilization",
        f"{GPU_MEMORY / engines:.3f}",
    ]
    return command + (["--enforce-eager"] if args.enforce_eager else [])


def time_in_turn(engines: dict[str, HeldEngine], args, payload: dict) -> None:
    """Each workload on every engine, ``args.rounds`` rounds (round r: balanced order r and
    its reverse), into ``payload["runs"][workload][label]`` (per round: its two runs'
    tokens/s)."""
    from tqdm import tqdm

    orders = [order + order[::-1] for order in balanced_orders(list(engines))]
    for workload in map(Workload.parse, args.workloads):
        name = workload.name
        runs = payload["runs"].setdefault(name, {label: [] for label in engines})
        for engine in engines.values():
            engine.ask(f"warm {name}")
        for round_ in tqdm(range(args.rounds), desc=name, unit="round"):
            times = {label: [] for label in engines}
            for label in orders[round_ % len(orders)]:
                time.sleep(args.settle)
                times[label].append(engines[label].ask(f"time {name}")["seconds"])
            for label, seconds in times.items():
                runs[label].append(len(seconds) * workload.counted_tokens / sum(seconds))
            write_report(args, payload)


def write_report(args, payload: dict) -> str:
    payload["results"] = summarise(payload)
    write_json(args.out / f"{args.name}.json", payload)
    text = markdown(payload)
    (args.out / f"{args.name}.md").write_text(text)
    return text


def checkpoints(root: Path, args) -> tuple[dict[str, Path], dict[str, str]]:
    """The engines' checkpoints by label, and the kernel mode of those not in ``args.mode``."""
    if args.quantize == "w8a8":
        return build_w8a8_checkpoints(root, args.shape, args.layers, args.sparsity)
    return build_checkpoints(root, args.shape, args.layers, args.dtype, args.sparsity), {}


def run(args, python: str, payload: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        paths, modes = checkpoints(Path(root), args)
        # the model the checkpoints came from is gone: its freed heap goes back to the OS
        # before the engines load (7B-shaped, 4 layers: 1.01 -> 0.53 GiB resident; with 16
        # layers this process had held 2.9 GiB beside the three engines)
        gc.collect()
        release_freed_heap()
        engines: dict[str, HeldEngine] = {}
        try:
            for label, path in paths.items():
                print(f"starting the {label} engine", flush=True)
                log = Path(root, f"{label.replace('%', 'pct').replace(':', 'of')}.log")
                mode = modes.get(label, args.mode)
                command = engine_command(python, path, label, mode, len(paths), args)
                engines[label] = HeldEngine(command, label, log, args.timeout)
                payload["engines"][label] = {"loaded": engines[label].loaded}
            time_in_turn(engines, args, payload)
        except RuntimeError as error:
            payload["error"] = str(error)
            raise
        finally:
            for label, engine in engines.items():
                payload["engines"][label]["closed"] = engine.close()
            write_report(args, payload)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="7b", choices=list(LLAMA_SIZES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--mode", default="auto", choices=KERNEL_MODES)
    parser.add_argument(
        "--sparsity",
        nargs="+",
        default=["0.5", "0.65"],
        help="the compressed checkpoints: 2:4 and/or sparsities in (0, 1)",
    )
    parser.add_argument(
        "--quantize",
        default="none",
        choices=["none", "w8a8"],
        help="w8a8: the compressed checkpoints pruned and quantized W8A8 by llmcompressor in "
        "one recipe, against dense bf16 and dense W8A8 (the first of them served dense)",
    )
    parser.add_argument("--workloads", nargs="+", default=["decode:1x64"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds between two runs")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds an engine may take to load or to answer",
    )
    parser.add_argument("--python", default=None, help="the serving environment's Python")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="vllm_paired", help="the report's file name stem")
    args = parser.parse_args(argv)
    check_workloads(parser, args.workloads)
    check_serving_sparsities(parser, args.sparsity)
    if args.quantize == "w8a8" and args.dtype != "bfloat16":
        parser.error(
            f"--quantize w8a8 takes --dtype bfloat16 (the recipes' W8A8), not {args.dtype}"
        )
    if args.layers < 1 or args.rounds < 1 or args.settle < 0 or args.timeout <= 0:
        parser.error(
            "--layers and --rounds must be at least 1, --settle at least 0, --timeout above 0"
        )
    return args


def main(argv=None) -> int:
    from whisper_sparse.driver.worker_process import serving_python

    args = parse_args(argv)
    python = str(serving_python(args.python))
    payload = {
        "config": vars(args) | {"out": str(args.out), "python": python},
        "cpu": cpu_line(),
        **run_stamp(),
        "engines": {},
        "runs": {},
    }
    try:
        run(args, python, payload)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(write_report(args, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
