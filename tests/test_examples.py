"""The example that runs here works end to end."""

from __future__ import annotations

import runpy
import sys

from conftest import REPO, SHARED


def test_stories260k_example(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["stories260k.py", str(SHARED)])
    runpy.run_path(str(REPO / "examples" / "stories260k.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "dense       perplexity" in printed and "whisper     perplexity" in printed
