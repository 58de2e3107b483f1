"""The example that runs here works end to end."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys

from conftest import REPO, SHARED
from whisper_sparse import QUANT_METHOD


def test_stories260k_example(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["stories260k.py", str(SHARED)])
    runpy.run_path(str(REPO / "examples" / "stories260k.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "dense       perplexity" in printed and "whisper     perplexity" in printed


def test_the_readme_python_snippet_runs_as_written(tmp_path):
    """README's "Use" block, verbatim, in a fresh process whose working directory holds
    the repository's recipes (the snippet names recipes/whisper_2of4.yaml)."""
    readme = (REPO / "README.md").read_text()
    (snippet,) = re.findall(r"<!-- use-snippet[^>]*-->\n```python\n(.*?)```", readme, re.S)
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    done = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((tmp_path / "smollm2-whisper-2of4" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # oneshot's own save wrote the compressed 2:4 checkpoint, of the size the README says
    assert config["quantization_config"]["quant_method"] == QUANT_METHOD
    (printed,) = re.findall(r"^(\d+) MiB$", done.stdout, re.M)
    said = re.search(r'print\(f"\{weights / 2\*\*20:.0f\} MiB"\)  # (\d+) MiB', readme)
    assert said and int(printed) == int(said.group(1)), (printed, said)
