"""ruff owns the layout and the lint of every Python file in the repository (pyproject.toml's
settings): ``ruff format --check`` and ``ruff check`` find nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def _ruff() -> str:
    found = Path(sys.executable).with_name("ruff")
    if found.is_file():
        return str(found)
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (pip install '.[test]')")
    return "ruff"


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "check"])
def test_ruff_finds_nothing(command):
    done = subprocess.run(
        [_ruff(), *command, str(REPO)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
