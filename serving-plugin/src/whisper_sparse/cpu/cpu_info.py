"""This CPU's facts, from ``/proc/cpuinfo``: its flags and model name, for the plans' cache
key, the serving probe's capability line and the benchmarks' CPU labels.

Imports only the standard library, so that the benchmarks run with torch alone (a GPU
machine's image has no loguru, which the serving driver needs).
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["CPU_FLAGS", "cpu_flag_set", "cpu_flags", "cpu_identity", "cpu_model"]

# the flags the capability line and the benchmarks' labels show
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_flags() -> str:
    """The first ``flags`` (x86) or ``Features`` (ARM) line; the processor's name where
    there is none."""
    for line in _cpuinfo_lines():
        if line.startswith(("flags", "Features")):
            return line
    return platform.processor()


def cpu_flag_set() -> set[str]:
    """This CPU's flags (``avx2``, ``avx512f``, ``amx_int8``, ...)."""
    return set(cpu_flags().split(":", 1)[-1].split())


def cpu_model() -> str:
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def cpu_identity() -> str:
    """Every distinct model-name and flags line, sorted: the same on every core of one
    machine, different where the CPU or its exposed flags differ."""
    lines = {line for line in _cpuinfo_lines() if line.startswith(("model name", "flags"))}
    return "\n".join(sorted(lines))
