"""The 2:4 CPU kernels (``kernels/``) compiled on first use into the cache and loaded
into torch: ``load_cpu_kernels()``.

Built with the machine's C++ compiler against the installed torch's headers and libraries
(no build isolation, so no other torch is ever fetched), once per source, torch and
compiler: the library lands in ``cache_dir()/cpu_kernels/KEY`` by an atomic rename, under a
file lock, so that processes starting together (vLLM's tensor-parallel workers) build it
once. Where it cannot be built or loaded, ``load_cpu_kernels`` returns why, in one line,
and the 2:4 layers run as before (decompressed).

Imports only torch (and this subpackage).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from whisper_sparse.paths import cache_dir

__all__ = [
    "CPU_OP_NAMESPACE",
    "KERNEL_SOURCES",
    "build_key",
    "library_path",
    "load_cpu_kernels",
    "loaded_build_key",
]

CPU_OP_NAMESPACE = "whisper_sparse_cpu"
SOURCE_DIR = Path(__file__).with_name("kernels")
KERNEL_SOURCES = (
    "avx2.cpp",
    "avx2_bitmask.cpp",
    "avx512.cpp",
    "avx512_bf16.cpp",
    "avx512_bf16_gemm.cpp",
    "avx512_bf16_bitmask_gemm.cpp",
    "avx512_bf16_grouped.cpp",
    "int8_avx2.cpp",
    "int8_avx_vnni.cpp",
    "int8_avx512_vnni.cpp",
    "int8_avx512_vnni_tiles.cpp",
    "int8_op.cpp",
    "op.cpp",
    "op_amx.cpp",
    "op_brgemm.cpp",
    "op_gemm.cpp",
    "op_isa.cpp",
    "op_tiles.cpp",
)
HEADERS = (
    "sparse_kernels.h",
    "avx2_byte_tables.h",
    "amx_tiles.h",
    "avx512_bf16_parts.h",
    "bitmask_gemm_reads.h",
    "int8_avx512_vnni.h",
    "int8_kernels.h",
    "int8_op.h",
    "int8_rows_256.h",
    "int8_tiles_256.h",
    "op_amx.h",
    "op_brgemm.h",
    "op_buffers.h",
    "op_gemm.h",
    "op_isa.h",
    "op_layer.h",
    "op_tiles.h",
    "transpose16.h",
)
LIBRARY = f"lib{CPU_OP_NAMESPACE}.so"
BUILD_TIMEOUT = 600  # seconds for one source file
# No fused multiply-adds the sources do not ask for: the W8A8 outputs round s_x * s_w * sum + b
# in vLLM's order, one operation at a time, to equal its layer and the reference bit for bit.
CODE_FLAGS = ("-O3", "-std=c++17", "-ffp-contract=off")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return done.stdout.splitlines()[0] if done.stdout else compiler


@functools.cache
def build_key(compiler: str) -> str:
    """What the library is built from: its sources, torch and the compiler (a digest)."""
    digest = hashlib.sha256()
    for name in (*KERNEL_SOURCES, *HEADERS):
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(CODE_FLAGS).encode())
    digest.update(f"{torch.__version__} {_compiler_version(compiler)} {sys.platform}".encode())
    return digest.hexdigest()[:16]


def library_path(compiler: str) -> Path:
    """Where the library built from these sources, for this torch and compiler, lives."""
    return cache_dir() / "cpu_kernels" / build_key(compiler) / LIBRARY


def _flags() -> tuple[list[str], list[str]]:
    """Compile and link flags against the installed torch."""
    root = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [
        *CODE_FLAGS,
        "-fPIC",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-I",
        str(SOURCE_DIR),
        "-isystem",
        str(root / "include"),
    ]
    # -fopenmp links libgomp.so.1 by its name: torch's own copy, loaded first, is the one used
    link_flags = [
        "-shared",
        "-fopenmp",
        f"-L{root / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        f"-Wl,-rpath,{root / 'lib'}",
    ]
    return compile_flags, link_flags


def _build(compiler: str, target: Path) -> None:
    """Compile the sources in parallel and link them into ``target`` (atomically)."""
    compile_flags, link_flags = _flags()
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent.parent))
    try:
        objects, running = [], []
        for name in KERNEL_SOURCES:
            obj = staging / f"{Path(name).stem}.o"
            command = [compiler, *compile_flags, "-c", str(SOURCE_DIR / name), "-o", str(obj)]
            running.append(
                subprocess.Popen(
                    command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
            objects.append(obj)
        for process in running:
            output, _ = process.communicate(timeout=BUILD_TIMEOUT)
            if process.returncode:
                raise RuntimeError(_first_error(output))
        done = subprocess.run(
            [compiler, *map(str, objects), *link_flags, "-o", str(staging / LIBRARY)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
        )
        if done.returncode:
            raise RuntimeError(_first_error(done.stdout + done.stderr))
        for obj in objects:
            obj.unlink()
        os.replace(staging, target.parent)  # the directory appears complete or not at all
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _first_error(output: str) -> str:
    lines = [line for line in output.splitlines() if "error" in line.lower()]
    return (lines or output.splitlines() or ["the compiler failed"])[0].strip()


def loaded_build_key() -> str | None:
    """``build_key`` of the library ``load_cpu_kernels`` loads (None without a compiler)."""
    compiler = _compiler()
    return None if compiler is None else build_key(compiler)


@functools.cache
def load_cpu_kernels() -> str | None:
    """Build (once) and load the kernels into torch (``torch.ops.whisper_sparse_cpu``);
    None when they are loaded, else why not, in one line."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"no 2:4 CPU kernel for {platform.machine()} on {sys.platform} (x86-64 Linux only)"
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found (set CXX or install g++)"
    try:
        target = library_path(compiler)
        if not target.is_file():
            target.parent.parent.mkdir(parents=True, exist_ok=True)
            with open(target.parent.parent / ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one build; the others wait, then load it
                if not target.is_file():
                    _build(compiler, target)
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return f"the 2:4 CPU kernels could not be built: {str(error).splitlines()[0]}"
    if getattr(torch.ops, CPU_OP_NAMESPACE).isa() == "none":
        return "this CPU has neither AVX2 with FMA nor AVX-512, which the 2:4 CPU kernels need"
    return None
