"""The quality benchmark end to end on stories260K (a smoke run: 2 methods, 2 seeds)."""

from __future__ import annotations

import json
import statistics
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import quality  # noqa: E402


def test_quality_benchmark_writes_tables_and_plots(tmp_path):
    argv = ["--models", "stories260K", "--methods", "wanda", "wisp", "--seeds", "2",
            "--sparsities", "2:4", "0.5", "--num-sequences", "4", "--seq-len", "64",
            "--out", str(tmp_path)]  # fmt: skip
    assert quality.main(argv) == 0
    results = json.loads((tmp_path / "quality.json").read_text())
    entry = results["models"]["stories260K"]
    for label in ("2:4", "0.5"):
        for method in ("wanda", "wisp"):
            cell = entry["runs"][label][method]
            ppls = [run["perplexity"] for run in cell["runs"]]
            assert len(ppls) == 2 and cell["perplexity"] == statistics.fmean(ppls)
            assert cell["perplexity"] > entry["dense"]
    table = (tmp_path / "quality.md").read_text()
    assert "| wisp |" in table and "2:4 ppl" in table
    for png in ("perplexity_vs_sparsity.png", "perplexity_vs_time.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
