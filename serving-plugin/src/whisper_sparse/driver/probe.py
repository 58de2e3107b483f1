"""What the installed vLLM can do with a checkpoint on this machine, asked before any
engine starts.

* ``serving_plan`` / ``serving_dtype``: the ``--dtype`` a quantized checkpoint is served
  with on a CPU, measured by vLLM's own kernels (one process per candidate dtype, so a
  kernel that aborts its process refuses only its own dtype), and what the plugin does in
  place of an emulated FP8 path (``notes``). Raises ``ServingUnavailable`` where the
  build lacks what the checkpoint needs.
* What the serving environment's vLLM has on this CPU is ``capabilities.py``'s.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from whisper_sparse.cpu.cpu_info import cpu_flag_set, cpu_flags
from whisper_sparse.cpu.fp8 import EMULATED_FP8_NOTE
from whisper_sparse.driver.capabilities import capabilities
from whisper_sparse.driver.worker_process import (
    WorkerFailed,
    on_cpu,
    run_worker,
    serving_env,
    serving_python,
)
from whisper_sparse.format.checkpoint import check_checkpoint
from whisper_sparse.format.declaration import is_ours
from whisper_sparse.paths import cache_dir, write_json_atomically

__all__ = [
    "ServingPlan",
    "ServingUnavailable",
    "is_quantized",
    "refusal_cause",
    "required_ops",
    "unavailable_ops",
    "serving_dtype",
    "serving_plan",
]

# vLLM's CPU op for each quantized scheme that needs one which not every CPU build has
WEIGHT_ONLY_4BIT_OP = "cpu_gemm_wna16"
PROBE_TIMEOUT = 240  # seconds per candidate dtype: start vLLM, a few decodes, one prefill
PROBE_VERSION = 4  # part of the cache key: what a cached answer holds
PROBE_MODEL_LEN = 1024  # the probe engine's max_model_len (at most the model's)
PROBE_PREFILL_TOKENS = 512  # one prompt of this many tokens, scored: prefill-sized batches
PROBE_DECODE_BATCH = 4  # greedy decodes side by side
QUANTIZED_CANDIDATES = ["auto", "bfloat16", "float16"]
DENSE_CANDIDATES = ["auto", "float32"]
# the serving environment's variables that change which kernels run
PROBED_VARIABLES = (
    "ONEDNN_",
    "DNNL_",
    "VLLM_CPU_",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "WHISPER_MODIFIERS_",
    "OMP_NUM_THREADS",
    "ATEN_CPU_CAPABILITY",
)
AMX_FLAGS = {"amx_tile", "amx_int8", "amx_bf16"}


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


def probe_request(checkpoint: Path, config: dict, dtype: str) -> dict:
    """The worker's request to serve ``checkpoint`` in ``dtype`` as a served request runs
    (``vllm_worker.probe_serving``)."""
    positions = int(config.get("max_position_embeddings") or PROBE_MODEL_LEN)
    max_model_len = min(positions, PROBE_MODEL_LEN)
    return {
        "probe": True,
        "model": str(checkpoint.resolve()),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "decode_batch": PROBE_DECODE_BATCH,
        "prefill_tokens": min(PROBE_PREFILL_TOKENS, max_model_len - 1),
        "required_ops": required_ops(config),
    }


def required_ops(config: dict) -> list[str]:
    """The vLLM CPU ops a checkpoint's scheme needs that not every CPU build has."""
    return [WEIGHT_ONLY_4BIT_OP] if _weight_only_4bit(scheme_config(config)) else []


def _weight_only_4bit(scheme: dict) -> bool:
    """Whether a compressed-tensors config has 4-bit weight-only (W4A16) groups."""
    return any(
        (group.get("weights") or {}).get("num_bits") == 4 and not group.get("input_activations")
        for group in (scheme.get("config_groups") or {}).values()
    )


def scheme_config(config: dict) -> dict:
    """The compressed-tensors quantization config whose kernels serve the checkpoint (for a
    compressed 2:4 chain, the one nested in its ``quantization_config``)."""
    quantization = config.get("quantization_config") or {}
    if is_ours(quantization):
        return quantization.get("quantization_config") or {}
    return quantization


def is_quantized(config: dict) -> bool:
    return bool(scheme_config(config).get("config_groups"))


def probe_environment() -> dict[str, str]:
    """The variables of the serving environment that change which kernels run
    (oneDNN's ISA cap, vLLM's CPU settings, the plugin's kernel mode, threads)."""
    return {
        key: value
        for key, value in sorted(serving_env().items())
        if key.startswith(PROBED_VARIABLES)
    }


def refusal_cause(ending: str) -> str | None:
    """What a serving process that ended so (``exit_description``) says about this
    machine, when it names a cause: an illegal instruction on a CPU with AMX is AMX that
    the process may not use (the OS, a VM or a container did not grant it, or oneDNN's ISA
    is capped, so nothing asked for it) while vLLM's AMX kernels still run."""
    if "SIGILL" not in ending:
        return None
    if cpu_flag_set() & AMX_FLAGS:
        capped = [
            f"{key}={value}"
            for key, value in probe_environment().items()
            if key.endswith("MAX_CPU_ISA")
        ]
        return (
            "AMX present but not usable in this process, or capped"
            + (f" ({', '.join(capped)})" if capped else "")
            + ": vLLM's AMX kernels died with an illegal instruction"
        )
    return "an instruction this CPU or process does not allow killed vLLM (SIGILL)"


def probe_dtypes(checkpoint: Path, config: dict, candidates: list[str], python: Path) -> dict:
    """Serve ``checkpoint`` in each of ``candidates`` in turn, each in its own process
    (``vllm_worker.probe_serving``), until one runs: ``{"dtype": the accepted one or None,
    "errors": {dtype: why refused}, "missing_ops", "emulated_fp8", "kernels",
    "resolved"}``. A process that dies (a signal, a C++ ``terminate``) or runs past
    ``PROBE_TIMEOUT`` refuses its dtype, with the cause where it can be named
    (``refusal_cause``)."""
    answer = {
        "dtype": None,
        "errors": {},
        "missing_ops": [],
        "emulated_fp8": False,
        "kernels": {},
        "resolved": {},
        "timed_out": False,
    }
    for dtype in candidates:
        request = probe_request(checkpoint, config, dtype)
        try:
            reply = run_worker(request, python, PROBE_TIMEOUT, f"vLLM serving in {dtype}")
        except WorkerFailed as ended:
            last = ended.tail.splitlines()[-1:] or [""]
            cause = refusal_cause(ended.ending)
            answer["errors"][dtype] = cause or f"the process ended ({ended.ending}): {last[0]}"
            answer["timed_out"] |= ended.ending.startswith("stopped after")
            continue
        if reply["missing_ops"]:  # no dtype can help
            answer["missing_ops"] = reply["missing_ops"]
            break
        answer["errors"].update(reply["errors"])
        if reply["accepted"]:
            answer.update(
                dtype=dtype,
                emulated_fp8=reply["emulated_fp8"],
                kernels=reply["kernels"],
                resolved=reply["resolved"],
            )
            break
    return answer


def serving_plan(
    checkpoint: str | Path, python: str | Path | None = None, dtype: str | None = None
) -> ServingPlan:
    """How vLLM serves ``checkpoint`` here: ``--dtype`` ``dtype`` if given, else the first
    of the candidates vLLM runs here (``auto``, vLLM's own choice: the checkpoint's dtype,
    or bfloat16 for a float32 one on a CPU; then bfloat16 and float16 for a quantized
    checkpoint, float32 for an unquantized one). On a CPU each candidate is served the way
    a request is before any server starts (``probe_dtypes``: the engine, a batch of
    decodes and a prompt of ``PROBE_PREFILL_TOKENS``), so a kernel that dies (vLLM's AMX
    kernels where AMX is not usable, a missing op, a dtype a kernel has no version for)
    refuses its dtype here, not in the middle of a request. The answer depends on the CPU
    and the serving environment (``probe_environment``), so it is measured once per
    serving Python, CPU, environment, checkpoint and dtype, and cached.

    Where vLLM's FP8 path on this CPU is its pure-PyTorch emulation, a compressed 2:4
    chain is served with the FP8 weights dequantized by the plugin (a note says so), and
    any other FP8_DYNAMIC checkpoint is refused before any engine starts. Raises
    ``ServingUnavailable`` when the build lacks an op the scheme needs or no candidate
    runs; ``check_checkpoint``'s errors come first."""
    config = check_checkpoint(checkpoint)
    if not on_cpu():
        return ServingPlan(dtype or "auto")
    python = serving_python(python)
    _refuse_emulated_fp8(checkpoint, config, python)
    quantized = is_quantized(config)
    candidates = [dtype] if dtype else (QUANTIZED_CANDIDATES if quantized else DENSE_CANDIDATES)
    answer = _probed(Path(checkpoint), config, candidates, python)
    if answer["missing_ops"]:
        raise unavailable_ops(checkpoint, answer["missing_ops"])
    if answer["dtype"] is None:
        tried = "; ".join(f"{name}: {why}" for name, why in answer["errors"].items())
        raise ServingUnavailable(
            f"vLLM cannot serve {checkpoint} on this CPU in any of {', '.join(candidates)} "
            f"(each tried as a served request runs, before any server starts): {tried}"
        )
    chosen = answer["dtype"]
    resolved = answer["resolved"].get(chosen, None if chosen == "auto" else chosen)
    notes = ()
    if answer["emulated_fp8"]:  # our compressed chain: the plugin dequantized the weights
        kernel = sorted(set(answer["kernels"].values()))[0]
        notes = (EMULATED_FP8_NOTE.format(kernel=kernel, dtype=resolved or chosen),)
    return ServingPlan(chosen, resolved, notes)


def _refuse_emulated_fp8(checkpoint: str | Path, config: dict, python: Path) -> None:
    """Raise ``ServingUnavailable`` for an FP8_DYNAMIC checkpoint not ours where vLLM's FP8
    path on this CPU is its emulation (before any engine starts)."""
    if is_ours(config.get("quantization_config")) or not _dynamic_fp8(scheme_config(config)):
        return
    kernel = capabilities(python)["fp8_dynamic_kernel"]
    if kernel.endswith("(emulated)"):
        raise ServingUnavailable(
            f"{checkpoint}: vLLM runs this checkpoint's FP8 layers on this CPU only "
            f"through its emulated path ({kernel.split()[0]}, torch._scaled_mm on the "
            "CPU: 10 decoded tokens/s on SmolLM2-135M where dequantized weights gave "
            "190, benchmarks/results/serving.md); save the chain in the compressed 2:4 layout "
            "(whisper-prune's default), whose vLLM plugin serves the FP8 weights "
            "dequantized to the model's dtype, or prune with a W8A8 chain"
        )


def _probed(checkpoint: Path, config: dict, candidates: list, python: Path) -> dict:
    """``probe_dtypes``' answer for these candidates, cached per serving Python, CPU,
    environment, checkpoint and candidates (an answer that timed out is not kept)."""
    key = hashlib.sha256(
        json.dumps(
            [
                PROBE_VERSION,
                str(python.resolve()),
                python.stat().st_mtime,
                cpu_flags(),
                probe_environment(),
                candidates,
                probe_request(checkpoint, config, ""),
            ],
            sort_keys=True,
        ).encode()
    ).hexdigest()
    cache = cache_dir() / "serving_dtypes.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    answer = known.get(key)
    if answer is None:
        answer = probe_dtypes(checkpoint, config, candidates, python)
        if not answer["timed_out"]:  # a machine too busy to answer may do better later
            known = json.loads(cache.read_text()) if cache.is_file() else {}
            known[key] = answer
            write_json_atomically(cache, known)
    return answer


def _dynamic_fp8(scheme: dict) -> bool:
    """Whether a compressed-tensors config has float8 weights with dynamic activations
    (FP8_DYNAMIC: what ``capabilities``' ``fp8_dynamic_kernel`` answers for)."""
    return any(
        (group.get("weights") or {}).get("type") == "float"
        and (group.get("weights") or {}).get("num_bits") == 8
        and (group.get("input_activations") or {}).get("dynamic") is True
        for group in (scheme.get("config_groups") or {}).values()
    )


def serving_dtype(checkpoint: str | Path, python: str | Path | None = None) -> str:
    """``serving_plan(checkpoint, python).dtype``: the ``--dtype`` vLLM serves it with."""
    return serving_plan(checkpoint, python).dtype


def unavailable_ops(checkpoint, missing: list[str]) -> ServingUnavailable:
    return ServingUnavailable(
        f"this checkpoint's W4A16 layers cannot be served by vLLM on this CPU (its build has "
        f"no {', '.join(f'`{op}`' for op in missing)}; it needs an x86 CPU with AVX-512, "
        "where vllm-cpu loads its AVX-512 build of the op, or a GPU with the vllm package); "
        f"{checkpoint}: prune with a W8A8 or FP8 chain to serve on this CPU"
    )
