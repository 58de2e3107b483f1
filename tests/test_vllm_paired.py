"""benchmarks/vllm_paired.py: engines held open and timed in turn, ratios round by round."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

GIB = 2**30


def loaded(rss_gib: float, ratio: float | None = None, dense_bytes: int = GIB) -> dict:
    return {
        "weights": {"ratio": ratio, "dense_bytes": dense_bytes},
        "rss_after_load": rss_gib * GIB,
        "rss_after_load_trimmed": rss_gib * GIB,
    }


def test_engines_run_in_balanced_mirrored_orders_and_ratios_are_per_round(tmp_path, monkeypatch):
    """Every round times the engines in one of the balanced orders, then in its reverse (over
    the rounds each engine takes each place); an engine's rate in a round is its two runs'
    tokens over their seconds, its ratio that over dense's in the same round (a slow round
    slows both and keeps the ratio), and the report gives the median, lowest and highest
    ratio, with resident memory saved over the dense weight bytes."""
    import vllm_paired

    order = []
    # seconds per run of 64 tokens: round 2 is a slow phase for every engine
    seconds = {
        "dense": [[4.0, 4.0], [8.0, 8.0], [4.0, 4.0]],
        "50%": [[2.0, 3.0], [5.0, 5.0], [2.5, 2.5]],
        "65%": [[2.0, 2.0], [4.0, 4.0], [1.0, 3.0]],
    }
    memory = {"dense": loaded(4.0), "50%": loaded(3.5, 0.56), "65%": loaded(3.4, 0.41)}

    class FakeEngine:
        def __init__(self, command, label, log, timeout):
            assert command[command.index("--label") + 1] == label
            assert "--enforce-eager" in command
            # on a GPU the three engines share 0.85 of its memory
            assert command[command.index("--gpu-memory-utilization") + 1] == "0.283"
            self.label, self.loaded, self.runs = label, memory[label], 0

        def ask(self, command):
            verb, workload = command.split()
            assert workload == "decode:1x64"
            if verb == "warm":
                return {"warm": workload}
            order.append(self.label)
            round_, run = divmod(self.runs, 2)
            self.runs += 1
            return {"seconds": seconds[self.label][round_][run]}

        def close(self):
            return {"rss_peak": 1}

    monkeypatch.setattr(vllm_paired, "HeldEngine", FakeEngine)
    argv = [
        "--shape",
        "tiny",
        "--layers",
        "1",
        "--dtype",
        "float32",
        "--rounds",
        "3",
        "--settle",
        "0",
        "--enforce-eager",
        "--python",
        sys.executable,
        "--out",
        str(tmp_path),
        "--name",
        "paired",
    ]
    assert vllm_paired.main(argv) == 0
    assert order == [
        "dense",
        "50%",
        "65%",
        "65%",
        "50%",
        "dense",
        "50%",
        "65%",
        "dense",
        "dense",
        "65%",
        "50%",
        "65%",
        "dense",
        "50%",
        "50%",
        "dense",
        "65%",
    ]
    results = json.loads((tmp_path / "paired.json").read_text())["results"]
    assert results["dense"]["workloads"]["decode:1x64"]["rounds"] == [16.0, 8.0, 16.0]
    half = results["50%"]["workloads"]["decode:1x64"]
    assert half["rounds"] == [25.6, 12.8, 25.6]
    assert half["ratios"] == [1.6, 1.6, 1.6] and half["ratio"] == 1.6
    most = results["65%"]["workloads"]["decode:1x64"]
    assert most["ratios"] == [2.0, 2.0, 2.0] and most["lowest"] == most["highest"] == 2.0
    assert results["50%"]["rss_saved"] == 0.5
    assert results["65%"]["rss_saved_trimmed"] == pytest.approx(0.6)
    table = (tmp_path / "paired.md").read_text()
    assert "| 50% | 0.56× | 3.50 | 0.50× | 0.50× | 25.6 | **1.60×** (1.60–1.60) |" in table
    assert "| 2 | 8.0 | 1.60× | 2.00× |" in table


def test_a_failing_engine_stops_the_run_naming_it_with_its_last_lines(tmp_path, capsys):
    """An engine that cannot start (here: no vLLM, or no checkpoint, in this Python) ends
    the run with an error naming the engine, how it ended and its output's last lines, and
    the report says the run stopped."""
    import vllm_paired

    argv = [
        "--shape",
        "tiny",
        "--layers",
        "1",
        "--dtype",
        "float32",
        "--sparsity",
        "0.5",
        "--rounds",
        "1",
        "--python",
        sys.executable,
        "--out",
        str(tmp_path),
        "--timeout",
        "120",
    ]
    assert vllm_paired.main(argv) == 1
    error = capsys.readouterr().err
    assert "the dense engine gave no answer (exit 1)" in error and "Error" in error
    assert (
        "**Stopped:** the dense engine gave no answer" in (tmp_path / "vllm_paired.md").read_text()
    )


def test_the_held_engine_answers_each_command_with_one_line(monkeypatch):
    """Loaded, it writes what it holds; ``warm`` runs two prompts untimed, ``time`` the
    whole workload; at the end of its input, its peak resident memory."""
    import vllm_held_engine
    from vllm_engine import parse_args as engine_options

    calls = []
    monkeypatch.setattr(
        vllm_held_engine,
        "start_engine",
        lambda args: ("llm", {"label": args.label}, {"vocab_size": 50}),
    )
    monkeypatch.setattr(
        vllm_held_engine,
        "run_workload",
        lambda llm, workload, prompts: calls.append(len(prompts)) or 0.5,
    )
    control = io.StringIO()
    args = engine_options(["ckpt", "--label", "50%", "--workloads", "decode:3x8"])
    vllm_held_engine.serve(args, control, ["warm decode:3x8\n", "time decode:3x8\n"])
    answers = [json.loads(line) for line in control.getvalue().splitlines()]
    assert answers[0] == {"label": "50%"} and answers[1] == {"warm": "decode:3x8"}
    assert answers[2] == {"workload": "decode:3x8", "seconds": 0.5, "tokens_per_s": 48.0}
    assert set(answers[3]) == {"rss_peak"} and calls == [2, 3]


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--settle", "-1"], ["--timeout", "0"]])
def test_bad_options_are_refused_before_any_work(bad, capsys):
    import vllm_paired

    with pytest.raises(SystemExit):
        vllm_paired.parse_args(bad)
    assert "--rounds" in capsys.readouterr().err


def test_w8a8_engines_are_compared_with_dense_bf16_and_dense_w8a8(tmp_path, monkeypatch):
    """With ``--quantize w8a8`` dense W8A8 is the first W8A8 checkpoint served in kernel mode
    ``dense``; each compressed engine's ratios and RSS saved are also taken against it, round
    by round, and the report has a table of them."""
    import vllm_paired

    seconds = {"dense": 4.0, "2:4 W8A8": 1.0, "dense W8A8": 2.0}
    memory = {"dense": loaded(4.0), "2:4 W8A8": loaded(2.0, 0.625), "dense W8A8": loaded(2.5)}
    paths = {label: tmp_path / label.replace(" ", "-") for label in seconds}
    paths["dense W8A8"] = paths["2:4 W8A8"]
    modes = {}

    class FakeEngine:
        def __init__(self, command, label, log, timeout):
            assert command[1] == str(paths[label])
            modes[label] = command[command.index("--mode") + 1]
            self.label, self.loaded = label, memory[label]

        def ask(self, command):
            return {"seconds": seconds[self.label]}

        def close(self):
            return {}

    built = []
    monkeypatch.setattr(vllm_paired, "HeldEngine", FakeEngine)
    monkeypatch.setattr(
        vllm_paired,
        "build_w8a8_checkpoints",
        lambda root, shape, layers, sparsities: (
            built.append(sparsities) or (paths, {"dense W8A8": "dense"})
        ),
    )
    argv = ["--sparsity", "2:4", "--quantize", "w8a8", "--rounds", "2", "--settle", "0"]
    argv += ["--python", sys.executable, "--out", str(tmp_path), "--name", "w8a8"]
    assert vllm_paired.main(argv) == 0
    assert built == [["2:4"]]
    assert modes == {"dense": "auto", "2:4 W8A8": "auto", "dense W8A8": "dense"}
    results = json.loads((tmp_path / "w8a8.json").read_text())["results"]
    sparse = results["2:4 W8A8"]
    assert sparse["workloads"]["decode:1x64"]["ratio"] == 4.0  # against dense bf16
    against = sparse["workloads"]["decode:1x64"]["against_w8a8"]
    assert against["ratios"] == [2.0, 2.0] and against["ratio"] == 2.0
    assert sparse["against_w8a8"]["rss_saved"] == 0.5
    assert results["dense W8A8"]["workloads"]["decode:1x64"]["ratio"] == 2.0
    assert "against_w8a8" not in results["dense W8A8"]
    table = (tmp_path / "w8a8.md").read_text()
    assert "## Against dense W8A8" in table
    assert "| 2:4 W8A8 | 0.50× | 0.50× | **2.00×** (2.00–2.00) |" in table


def test_the_w8a8_checkpoints_are_one_recipes_compressed_int8_layers(tmp_path):
    """``w8a8_checkpoints``: magnitude pruning and W8A8 in one ``oneshot`` recipe, stored in
    the 2:4 layout (2:4) and the bitmask layout (65 %), int8 values with per-row scales,
    ``lm_head`` left bf16; dense W8A8 is the 2:4 checkpoint."""
    from safetensors import safe_open
    from w8a8_checkpoints import build_w8a8_checkpoints

    paths, modes = build_w8a8_checkpoints(tmp_path, "tiny", 1, ["2:4", "0.65"])
    assert list(paths) == ["dense", "2:4 W8A8", "65% W8A8", "dense W8A8"]
    assert paths["dense W8A8"] == paths["2:4 W8A8"] and modes == {"dense W8A8": "dense"}
    for label, layout in (("2:4 W8A8", "targets"), ("65% W8A8", "bitmask_targets")):
        config = json.loads((paths[label] / "config.json").read_text())["quantization_config"]
        assert len(config[layout]) == 7  # every decoder Linear of the one layer
        with safe_open(paths[label] / "model.safetensors", "pt") as stored:
            values = stored.get_tensor("model.layers.0.mlp.up_proj.compressed")
            assert values.dtype == torch.int8
            assert "model.layers.0.mlp.up_proj.weight_scale" in stored.keys()
            assert stored.get_tensor("lm_head.weight").dtype == torch.bfloat16
        kept = values.numel() / (256 * 128)
        assert kept == pytest.approx(0.5 if label == "2:4 W8A8" else 0.35, abs=0.01)


def test_w8a8_takes_bfloat16(capsys):
    import vllm_paired

    with pytest.raises(SystemExit):
        vllm_paired.parse_args(["--quantize", "w8a8", "--dtype", "float32"])
    assert "--quantize w8a8 takes --dtype bfloat16" in capsys.readouterr().err
