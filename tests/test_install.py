"""Installing the package into an environment that already has llmcompressor's stack
leaves that stack alone: the declared ranges are llmcompressor 0.14.0.1's own.

The environment is a fresh virtual environment that sees this one's packages (a ``.pth``
file) but holds a torch of another version in range (a distribution's metadata, in front
of this environment's torch): pip's resolver, asked for a dry run with a report, must find
nothing to install but the package itself. Offline: every requirement is satisfied."""

from __future__ import annotations

import json
import site
import subprocess
import sys

import pytest

import whisper_modifiers
from conftest import REPO


def environment_with(tmp_path, torch_version: str):
    """A virtual environment whose own torch is ``torch_version`` (metadata only) and
    which sees this environment's packages behind it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    metadata = tmp_path / own / f"torch-{torch_version}.dist-info"
    metadata.mkdir(parents=True)
    (metadata / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n"
    )
    (metadata / "RECORD").write_text("")
    (tmp_path / own / "zz_this_environment.pth").write_text(site.getsitepackages()[0] + "\n")
    return python


def would_install(python, tmp_path) -> list[tuple[str, str]]:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--dry-run",
            "--no-build-isolation",
            "--no-index",
            "--report",
            str(report),
            "-e",
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [
        (item["metadata"]["name"], item["metadata"]["version"])
        for item in json.loads(report.read_text())["install"]
    ]


@pytest.mark.parametrize("torch_version", ["2.10.0", "2.11.0"])
def test_installing_beside_another_torch_in_range_keeps_it(tmp_path, torch_version):
    python = environment_with(tmp_path, torch_version)
    seen = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m; print(m.version('torch'), m.version('llmcompressor'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert seen == [torch_version, "0.14.0.1"]
    assert would_install(python, tmp_path) == [("whisper-modifiers", whisper_modifiers.__version__)]
