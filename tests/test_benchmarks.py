"""The quality benchmark end to end on stories260K (a smoke run: 2 methods, 2 seeds)."""

from __future__ import annotations

import json
import statistics
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import quality  # noqa: E402
import quality_report  # noqa: E402


def test_quality_benchmark_writes_tables_and_plots(tmp_path):
    argv = [
        "--models",
        "stories260K",
        "--methods",
        "wanda",
        "wisp",
        "--seeds",
        "2",
        "--sparsities",
        "2:4",
        "0.5",
        "--num-sequences",
        "4",
        "--seq-len",
        "64",
        "--out",
        str(tmp_path),
    ]
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


def test_gamma_auto_table_and_plot(tmp_path):
    """Issue 14's table on a smoke protocol: auto variants beside their baselines, the
    never-worse comparison, and the chosen gamma per layer."""
    threads = torch.get_num_threads()  # recorded with each run (and left as it is)
    argv = [
        "--gamma-auto",
        "--models",
        "stories260K",
        "--methods",
        "sparsegpt",
        "whisper:gamma=auto",
        "whisper",
        "--seeds",
        "2",
        "--sparsities",
        "2:4",
        "--num-sequences",
        "8",
        "--seq-len",
        "64",
        "--threads",
        str(threads),
        "--out",
        str(tmp_path),
    ]
    assert quality.main(argv) == 0
    entry = json.loads((tmp_path / "quality.json").read_text())["models"]["stories260K"]
    auto = entry["runs"]["2:4"]["whisper:gamma=auto"]
    for run in auto["runs"]:
        assert sorted(run["gamma"]) == sorted(
            f"model.layers.{i}.mlp.{p}" for i in range(5) for p in ("gate_proj", "up_proj")
        )
        assert set(run["gamma"].values()) <= {0.01, 0.1, 0.3, 1.0}
    assert not entry["runs"]["2:4"]["sparsegpt"]["runs"][0]["gamma"]
    (row,) = quality_report.baseline_comparisons(entry)
    baseline = entry["runs"]["2:4"]["sparsegpt"]["perplexity"]
    assert row["baseline"] == "sparsegpt"
    assert row["ratio_to_baseline"] == auto["perplexity"] / baseline
    assert (
        row["time_ratio_to_fixed"] == auto["seconds"] / entry["runs"]["2:4"]["whisper"]["seconds"]
    )
    seeds = {run["seed"]: run["perplexity"] for run in auto["runs"]}
    baseline_seeds = {r["seed"]: r["perplexity"] for r in entry["runs"]["2:4"]["sparsegpt"]["runs"]}
    assert row["seed_ratios"] == {seed: seeds[seed] / baseline_seeds[seed] for seed in (0, 1)}
    assert row["worst_seed_ratio"] == max(row["seed_ratios"].values())
    assert row["threads"] == [threads]  # every run compared was made at --threads
    assert all(
        run["selection"][name]["gamma"] == gamma
        for run in auto["runs"]
        for name, gamma in run["gamma"].items()
    )
    table = (tmp_path / "quality.md").read_text()
    assert "| 2:4 | whisper:gamma=auto | sparsegpt |" in table
    assert f"| 2:4 | whisper:gamma=auto | {row['seed_ratios'][0]:.3f} |" in table
    assert f"**{row['worst_seed_ratio']:.3f}** | {threads} |" in table
    assert (tmp_path / "gamma_per_layer.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "gamma_auto_ratios.png").read_bytes()[:4] == b"\x89PNG"


def test_run_cache_skips_runs_already_done(tmp_path, monkeypatch):
    import variant_runs

    cache = tmp_path / "runs.json"
    argv = [
        "--models",
        "stories260K",
        "--seeds",
        "2",
        "--num-sequences",
        "4",
        "--seq-len",
        "64",
        "--cache",
        str(cache),
        "--out",
        str(tmp_path),
    ]
    # num_permutations=1 is the default: the same recipe, so the same two runs
    assert quality.main([*argv, "--methods", "wisp", "wisp:num_permutations=1"]) == 0
    runs = json.loads(cache.read_text())
    assert len(runs) == 3  # two seeds and the dense model
    (dense,) = [run for run in runs.values() if "seed" not in run]
    assert (
        dense["perplexity"]
        == json.loads((tmp_path / "quality.json").read_text())["models"]["stories260K"]["dense"]
    )
    first = json.loads((tmp_path / "quality.json").read_text())["models"]["stories260K"]["runs"]
    assert first["2:4"]["wisp"] == first["2:4"]["wisp:num_permutations=1"]

    def no_pruning(*args, **kwargs):
        raise AssertionError("a cached run was pruned again")

    monkeypatch.setattr(variant_runs, "prune", no_pruning)
    monkeypatch.setattr(quality, "spec_perplexity", no_pruning)  # the dense run is cached too
    assert quality.main([*argv, "--methods", "wisp:num_permutations=1"]) == 0  # resumes
    again = json.loads((tmp_path / "quality.json").read_text())["models"]["stories260K"]["runs"]
    assert again["2:4"]["wisp:num_permutations=1"] == first["2:4"]["wisp"]
    # --cached-only: tables from finished cells; a cell never run is left out, not run, and
    # the model is not even loaded (the dense perplexity is cached too)
    monkeypatch.setattr(quality, "load", no_pruning)
    assert quality.main([*argv, "--cached-only", "--methods", "wisp", "wanda"]) == 0
    tables = json.loads((tmp_path / "quality.json").read_text())["models"]["stories260K"]["runs"]
    assert list(tables["2:4"]) == ["wisp"]


def test_eval_windows_are_one_for_all_models_or_one_per_model(capsys):
    argv = ["--models", "stories260K", "smollm2-135m", "--eval-windows", "1", "2", "3"]
    with pytest.raises(SystemExit):
        quality.main(argv)
    assert "--eval-windows takes 1 or 2 values" in capsys.readouterr().err


def test_speed_benchmark_reports_centered_ratios(tmp_path):
    import speed

    argv = [
        "--models",
        "stories260K",
        "--pairs",
        "main",
        "centered",
        "--repeats",
        "1",
        "--only",
        "wisp:pairing=centered",
        "whisper:pairing=centered",
        "--num-sequences",
        "4",
        "--seq-len",
        "64",
        "--out",
        str(tmp_path),
    ]
    assert speed.main(argv) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["models"]["stories260K"]["ratios"]
    assert [r["method"] for r in rows] == ["wisp:pairing=centered", "whisper:pairing=centered"]
    assert all(r["time_ratio"] > 0 and r["memory_ratio"] > 0 for r in rows)
    assert "wisp:pairing=centered / wanda" in (tmp_path / "speed.md").read_text()


def test_sparse_kernel_benchmark_without_cuda_says_so(capsys, tmp_path, monkeypatch):
    import sparse_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sparse_kernels.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_sparse_kernel_tables_and_plot_from_a_measured_payload(tmp_path):
    import sparse_kernels_report

    payload = json.loads((REPO / "benchmarks" / "results" / "sparse_kernels.json").read_text())
    sparse_kernels_report.write_tables(tmp_path, payload)
    table = (tmp_path / "sparse_kernels.md").read_text()
    assert "| 7B | gate_up | (22016, 4096) |" in table
    assert "| torch.compile | 8×4096 | 32768 |" in table
    assert (tmp_path / "sparse_kernels.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "sparse_kernels.json").read_text()) == payload


def test_random_layer_speed_keeps_the_rows_measured_before_a_stop(tmp_path, monkeypatch):
    """On a GPU the run has a time limit: each row is written as it is measured, so a run
    stopped by that limit (here at the second method) keeps the rows before it."""
    import speed
    import speed_random

    def measure(args, method, offload_device, batch_size, pipeline):
        if method == "wisp":
            raise KeyboardInterrupt  # the limit's kill
        return {
            "method": method,
            "pipeline": pipeline,
            "offload_device": offload_device,
            "batch_size": batch_size,
            "seconds": 3.0,
            "seconds_per_layer": 1.5,
            "layer_target": 1.6,
            "peak_bytes": 2**30,
        }

    monkeypatch.setattr(speed_random, "measure_random", measure)
    with pytest.raises(KeyboardInterrupt):
        speed.main(["--random-layers", "2", "--methods", "wanda", "wisp", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "speed_random.json").read_text())["rows"]
    assert [(r["method"], r["pipeline"]) for r in rows] == [
        ("wanda", "sequential"),
        ("wanda", "whisper_layerwise"),
    ]
    table = (tmp_path / "speed_random.md").read_text()
    # no reference in this run: its two columns are empty
    row = "| wanda | whisper_layerwise | cuda | 1 | 3.0 | 1.50 | ≤ 1.6 ✓ | - | - | 0.8 | 1.0 |"
    assert row in table


@pytest.mark.parametrize("bad", ["prefill:32", "decode:0x8", "train:2x8", "prefill:axb"])
def test_vllm_speed_refuses_a_bad_workload_before_any_engine(bad, capsys):
    import vllm_speed

    with pytest.raises(SystemExit):
        vllm_speed.parse_args(["--workloads", "decode:2x8", bad])
    assert f"--workloads: workload {bad!r}" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["3:4", "0", "1.0", "half"])
def test_sparsity_benchmarks_refuse_a_bad_sparsity_before_any_work(bad, capsys):
    import cpu_sparse_op
    import vllm_speed

    with pytest.raises(SystemExit):
        vllm_speed.parse_args(["--sparsity", "2:4", bad])
    with pytest.raises(SystemExit):
        cpu_sparse_op.main(["--sparsity", bad])
    assert (
        capsys.readouterr().err.count(
            f"--sparsity takes 2:4 or a fraction between 0 and 1, not {bad!r}"
        )
        == 2
    )


def test_cpu_op_benchmark_by_sparsity(tmp_path, monkeypatch):
    """benchmarks/cpu_sparse_op.py over 2:4 and two unstructured sparsities on one small
    shape: every layout timed against dense, the bytes of each layout, the summary table
    and the plot of speed against sparsity."""
    import cpu_sparse_op

    from whisper_sparse.cpu.op import cpu_isa, cpu_kernels_unavailable

    if cpu_kernels_unavailable():
        pytest.skip(cpu_kernels_unavailable())
    monkeypatch.setattr(cpu_sparse_op, "SHAPES", {"7B": {"o": (64, 256)}})
    argv = [
        "--sparsity",
        "2:4",
        "0.5",
        "0.7",
        "--tokens",
        "1",
        "4",
        "--repeats",
        "1",
        "--working-set",
        "1",
        "--dtype",
        "float32",
        "--out",
        str(tmp_path),
    ]
    assert cpu_sparse_op.main(argv) == 0
    stem = tmp_path / f"cpu_sparse-{cpu_isa()}"
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert list(payload["sparsities"]) == ["2:4", "0.5", "0.7"]
    bytes_ratio = {
        s: e["shapes"]["7B/o"][0]["op_bytes_ratio"] for s, e in payload["sparsities"].items()
    }
    # float32: 2:4 keeps half the values plus a bit per input; the bitmask layout the kept
    # values, a bit per input and an 8-byte offset per row
    assert bytes_ratio["2:4"] == pytest.approx(0.5 + 1 / 32)
    for sparsity in ("0.5", "0.7"):
        assert bytes_ratio[sparsity] == pytest.approx(
            1 - float(sparsity) + 1 / 32 + 8 / 1024, abs=0.02
        )
        rows = payload["sparsities"][sparsity]["shapes"]["7B/o"]
        assert [row["tokens"] for row in rows] == [1, 4]
        assert all(row["ratio"] > 0 and "gemm" not in row["seconds"] for row in rows)
    table = stem.with_suffix(".md").read_text()
    assert "| 0.7 | " in table and "## 2:4" in table and "## 0.5" in table
    assert stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_the_sparsity_plot_puts_bf16_and_int8_against_dense_bf16(tmp_path):
    """Medians over the shapes of each run's ratio against dense bfloat16, the int8 ones from
    two runs merged, dense W8A8 as dense bf16 time over its own, and both bytes bounds."""
    import sparsity_plot

    def bf16_row(tokens, ratio):
        return {"tokens": tokens, "ratio": ratio, "vllm_ratio": None}

    def int8_row(tokens, vs_bf16, w8a8_s):
        seconds = {"bf16": 1.0, "w8a8": w8a8_s}
        return {
            "tokens": tokens,
            "best": "tiles",
            "vs_bf16": {"tiles": vs_bf16},
            "seconds": seconds,
        }

    bf16 = {"cpu": "c", "dtype": "bfloat16", "sparsities": {}}
    for key, ratios in {"2:4": (1.0, 1.2, 2.0), "0.65": (1.5, 1.6, 1.7)}.items():
        shapes = {f"s{i}": [bf16_row(1, r), bf16_row(16, r / 2)] for i, r in enumerate(ratios)}
        bf16["sparsities"][key] = {"shapes": shapes}
    first = {"cpu": "c", "int8_kernels": "avx2", "sparsities": {"2:4": {}}}
    first["sparsities"]["2:4"] = {"a": [int8_row(1, 3.0, 0.5)], "b": [int8_row(1, 2.0, 0.25)]}
    second = {
        "cpu": "c",
        "int8_kernels": "avx2",
        "sparsities": {"0.65": {"a": [int8_row(1, 4.0, 0.5)]}},
    }
    paths = []
    for name, payload in {"b": bf16, "i1": first, "i2": second}.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(payload))
    stem = tmp_path / "plot"
    sparsity_plot.main(
        ["--bf16", str(paths[0]), "--int8", *map(str, paths[1:]), "--out", str(stem)]
    )
    text = stem.with_suffix(".md").read_text()
    assert "| 1 | 2:4 | 1.20× | 1.78× | 2.50× | 3.20× | 3.00× |" in text
    assert "| 1 | 0.65 | 1.60× | 2.42× | 4.00× | 4.21× | 2.00× |" in text
    assert "| 16 | 0.65 | 0.80× | 2.42× | - | 4.21× | - |" in text
    with pytest.raises(SystemExit):
        sparsity_plot.main(["--bf16", str(paths[1]), "--int8", str(paths[1]), "--out", str(stem)])


def test_cpu_token_pass_times_every_layout_layer_after_layer(tmp_path, monkeypatch):
    """benchmarks/cpu_token_pass.py on a tiny two-layer model: each side's pass calls every
    layer's projections in model order, each layer with weights of its own; its ratios are
    per round against dense; its bytes are the layouts'; a table per token count; with
    ``--rows``, each unstructured sparsity's layers held as rows too, the same weights."""
    import cpu_token_pass

    from whisper_sparse.cpu.op import cpu_kernels_unavailable

    if cpu_kernels_unavailable():
        pytest.skip(cpu_kernels_unavailable())
    monkeypatch.setattr(cpu_token_pass, "SHAPES", {"7B": {"qkv": (96, 64), "o": (32, 64)}})
    argv = [
        "--layers",
        "2",
        "--sparsity",
        "2:4",
        "0.5",
        "--tokens",
        "1",
        "3",
        "--dtype",
        "float32",
        "--rounds",
        "3",
        "--out",
        str(tmp_path),
        "--name",
        "pass",
    ]
    args = cpu_token_pass.parse_args(argv)
    passes, weight_bytes, baseline = cpu_token_pass.model_sides(args, torch.float32)
    assert list(passes) == ["dense", "2:4", "50%"]
    for layer_pass in passes.values():
        assert [name for name, _ in layer_pass] == ["qkv", "o", "qkv", "o"]
        calls = [call for _, call in layer_pass]
        assert len({id(call) for call in calls}) == 4  # each layer its own weights
        x = torch.randn(3, 64)
        assert calls[0](x).shape == (3, 96) and not torch.equal(calls[0](x), calls[2](x))
    # float32: dense 4 bytes a weight; 2:4 half the values and a bit per input
    assert weight_bytes["dense"] == 2 * (96 + 32) * 64 * 4
    assert weight_bytes["2:4"] == 2 * (96 + 32) * (32 * 4 + 8)
    with_rows, rows_bytes, _ = cpu_token_pass.model_sides(
        cpu_token_pass.parse_args([*argv, "--rows"]), torch.bfloat16
    )
    assert list(with_rows) == ["dense", "2:4", "50%", "50% rows"]  # the rows beside the served
    assert rows_bytes["50% rows"] == rows_bytes["50%"]
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(with_rows["50%"][0][1](x), with_rows["50% rows"][0][1](x))
    assert cpu_token_pass.main(argv) == 0
    payload = json.loads((tmp_path / "pass.json").read_text())
    assert payload["baseline"] in ("F.linear", "vLLM's dense GEMM (onednn_mm)")
    assert list(payload["results"]) == ["1", "3"]
    for sides in payload["results"].values():
        assert sides["dense"]["ratio"] == 1.0
        for side in sides.values():
            assert side["lowest"] <= side["ratio"] <= side["highest"]
            assert set(side["projections"]) == {"qkv", "o"}
    table = (tmp_path / "pass.md").read_text()
    assert "## 3 tokens" in table and "| 50% | " in table and "qkv ms | o ms |" in table


def test_cpu_op_benchmark_times_the_micro_kernels_tiles_where_they_run(tmp_path, monkeypatch):
    """In bfloat16, the table has the tiles through a micro-kernel ("brgemm") wherever one
    runs (the op's AMX tiles, or oneDNN's AVX512_BF16), so an AMX session measures them
    beside ATen's."""
    import cpu_sparse_op

    from whisper_sparse.cpu.op import (
        brgemm_kernel,
        cpu_kernels_unavailable,
        gemm_runs,
    )

    if cpu_kernels_unavailable():
        pytest.skip(cpu_kernels_unavailable())
    monkeypatch.setattr(cpu_sparse_op, "SHAPES", {"7B": {"o": (64, 512)}})
    argv = ["--tokens", "16", "--repeats", "1", "--working-set", "1", "--out", str(tmp_path)]
    assert cpu_sparse_op.main(argv) == 0
    (payload,) = [json.loads(path.read_text()) for path in tmp_path.glob("*.json")]
    (row,) = payload["shapes"]["7B/o"]
    runs = brgemm_kernel() != "none" and gemm_runs(torch.bfloat16, torch.bfloat16)
    assert ("brgemm" in row["seconds"]) is runs
    assert "brgemm ms" in next(tmp_path.glob("*.md")).read_text()


def test_the_cpu_op_benchmark_runs_without_the_serving_driver():
    """A GPU machine's image has torch but neither loguru nor llmcompressor (an H200's host
    CPU, an AMX Xeon, failed here): the op benchmark labels its CPU without them."""
    import subprocess

    code = (
        "import sys; sys.modules['loguru'] = sys.modules['llmcompressor'] = None; "
        "sys.path.insert(0, 'benchmarks'); import cpu_sparse_op; print(cpu_sparse_op.cpu_line())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "threads; op kernels" in done.stdout


def test_cpu_op_benchmark_times_the_w8a8_op_against_vllms_w8a8_layer(tmp_path):
    """``--dtype int8`` in the serving environment, on one small shape at 2:4 and 65 %: each
    path's output equals vLLM's oneDNN W8A8 layer before it is timed, and the table gives the
    ratios against vLLM's W8A8 layer and its bf16 GEMM; without the W8A8 kernels it says so."""
    import subprocess

    from whisper_sparse.driver.worker_process import serving_python

    try:
        python = serving_python()
    except FileNotFoundError as error:  # no serving environment: scripts/setup_serving.sh
        pytest.skip(str(error))
    argv = ["--dtype", "int8", "--shapes", "7B", "--sparsity", "2:4", "0.65", "--tokens", "1", "20"]
    argv += ["--repeats", "1", "--working-set", "1", "--out", str(tmp_path)]
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import cpu_sparse_op, cpu_int8_op; "
        "cpu_int8_op.SHAPES = {'7B': {'o': (64, 256)}}; "
        f"sys.exit(cpu_sparse_op.main({argv!r}))"
    )
    done = subprocess.run(
        [str(python), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    if "do not run here" in done.stdout:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    (json_file,) = tmp_path.glob("cpu_sparse_int8-*.json")
    payload = json.loads(json_file.read_text())
    for sparsity in ("2:4", "0.65"):
        rows = payload["sparsities"][sparsity]["7B/o"]
        assert [row["tokens"] for row in rows] == [1, 20]
        for row in rows:
            assert row["exact"] and all(row["exact"].values()), row["exact"]
            assert set(row["vs_w8a8"]) == set(row["vs_bf16"]) and "rows" in row["vs_w8a8"]
            assert row["best"] in row["vs_w8a8"]
    assert "| 7B/o |" in json_file.with_suffix(".md").read_text()


def test_cpu_op_benchmark_caps_the_op_and_dense_alike(tmp_path):
    """``--isa avx2``: the op's AVX2 kernels against dense as torch runs it on a CPU without
    AVX-512 (ATen's AVX2 GEMM, oneDNN capped), both caps set when the process starts, and
    the table says so; on an AVX2 CPU, its own kernels, named as usual."""
    import os
    import subprocess

    import cpu_sparse_op

    from whisper_sparse.cpu.op import cpu_isa, cpu_kernels_unavailable

    if cpu_kernels_unavailable():
        pytest.skip(cpu_kernels_unavailable())
    argv = [
        "--isa",
        "avx2",
        "--tokens",
        "1",
        "4",
        "--repeats",
        "1",
        "--working-set",
        "1",
        "--out",
        str(tmp_path),
    ]
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import cpu_sparse_op; "
        "cpu_sparse_op.SHAPES = {'7B': {'o': (64, 256)}}; "
        f"sys.exit(cpu_sparse_op.main({argv!r}))"
    )
    env = os.environ | cpu_sparse_op.DENSE_CAPS["avx2"]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    own = cpu_isa()
    stem = "cpu_sparse24-avx2" + ("" if own == "avx2" else f"-capped-on-{own}")
    payload = json.loads((tmp_path / f"{stem}.json").read_text())
    assert payload["torch_cpu_capability"] == "AVX2"
    assert "op kernels avx2" in payload["cpu"]
    assert ("ONEDNN_MAX_CPU_ISA=AVX2" in payload["cpu"]) is (own != "avx2")
    rows = payload["shapes"]["7B/o"]
    assert [row["tokens"] for row in rows] == [1, 4]
    assert all("gemm" not in row["seconds"] for row in rows)  # no GEMM below avx512_bf16


def test_cpu_op_benchmark_refuses_a_cap_the_process_did_not_start_with(capsys, monkeypatch):
    """In a process started without dense's caps, ``--isa avx2`` stops before any work and
    names them; from the command line the script starts itself again with them."""
    import cpu_sparse_op

    from whisper_sparse.cpu.op import CPU_ISAS

    assert cpu_sparse_op.ISAS == ("auto", *CPU_ISAS)  # the benchmark's choices, the op's kernels
    for name in cpu_sparse_op.DENSE_CAPS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        cpu_sparse_op.main(["--isa", "avx2"])
    assert (
        "--isa avx2 caps dense alike: start Python with ONEDNN_MAX_CPU_ISA=AVX2 "
        "ATEN_CPU_CAPABILITY=avx2" in capsys.readouterr().err
    )
    started = []
    monkeypatch.setattr(cpu_sparse_op.os, "execve", lambda *call: started.append(call))
    cpu_sparse_op.run_again_with_dense_caps(["--isa", "avx2", "--tokens", "1"])
    ((executable, argv, env),) = started
    assert argv == [executable, cpu_sparse_op.__file__, "--isa", "avx2", "--tokens", "1"]
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    started.clear()
    cpu_sparse_op.run_again_with_dense_caps(["--tokens", "1"])  # no cap asked: no new start
    assert not started


def test_workloads_count_the_tokens_they_time():
    from vllm_engine import Workload

    prefill, decode = Workload.parse("prefill:32x2048"), Workload.parse("decode:64x256")
    assert (prefill.prompt_len, prefill.max_tokens, prefill.counted_tokens) == (2048, 1, 65536)
    assert (decode.prompt_len, decode.max_tokens, decode.counted_tokens) == (16, 256, 16384)


def test_profile_watches_the_cpu_op():
    """``--profile`` reports the CPU op's calls and time per call, for its 2:4 and its
    unstructured layers alike (it once watched only the GPU op's name)."""
    from torch.profiler import ProfilerActivity, profile
    from vllm_engine import profile_summary

    from whisper_sparse.cpu.op import (
        bitmask_cpu_linear,
        cpu_kernels_unavailable,
        two_four_cpu_linear,
    )
    from whisper_sparse.cpu.served_layer import (
        random_two_four,
        random_unstructured,
    )
    from whisper_sparse.format.bitmask import compress_bitmask
    from whisper_sparse.format.two_four import compress_24

    if cpu_kernels_unavailable():
        pytest.skip(cpu_kernels_unavailable())
    x = torch.randn(2, 64)
    two_four = compress_24(random_two_four(32, 64, torch.float32))
    unstructured = compress_bitmask(random_unstructured(32, 64, torch.float32, 0.4))
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        two_four_cpu_linear(x, *two_four, None, 64)
        bitmask_cpu_linear(x, *unstructured, None, 64)
        bitmask_cpu_linear(x, *unstructured, None, 64)
    watched = profile_summary(profiler, on_gpu=False, top=5)["watched"]
    entry = watched["whisper_sparse_cpu::"]
    assert entry["calls"] == 3 and entry["cpu_us_per_call"] > 0
    assert "_cslt_sparse_mm" not in watched


def engine_result(
    tokens_per_s: float, rss_gib: float, dense_bytes: int = 0, trimmed_gib: float | None = None
) -> dict:
    return {
        "device": "H100",
        "weights": {"ratio": None, "packed_layers": 0, "dense_bytes": dense_bytes},
        "graphs": {"max_cudagraph_capture_size": 2048, "max_num_batched_tokens": 8192},
        "workloads": {"decode:2x8": {"tokens_per_s": tokens_per_s, "seconds": [0.16]}},
        "profiles": {},
        "rss_after_load": rss_gib * 2**30,
        "rss_after_load_trimmed": trimmed_gib and trimmed_gib * 2**30,
    }


def test_vllm_speed_reports_each_engine_as_it_finishes(tmp_path, monkeypatch):
    """Each engine's result is written as it comes, with its ratio against dense, so that
    a GPU run stopped by its time limit (here during the second engine) keeps the first."""
    import vllm_speed

    def run_engine(command, out, timeout):
        if "sparse" in command:
            raise KeyboardInterrupt  # the limit's kill
        assert command[command.index("--max-cudagraph-capture-size") + 1] == "2048"
        return engine_result(100.0, 3)

    monkeypatch.setattr(vllm_speed, "run_engine", run_engine)
    argv = [
        "--shape",
        "tiny",
        "--layers",
        "1",
        "--dtype",
        "float32",
        "--modes",
        "sparse",
        "--capture-sizes",
        "2048",
        "--workloads",
        "decode:2x8",
        "--python",
        sys.executable,
        "--out",
        str(tmp_path),
    ]
    with pytest.raises(KeyboardInterrupt):
        vllm_speed.main(argv)
    results = json.loads((tmp_path / "vllm_speed.json").read_text())["results"]
    assert (
        list(results) == ["dense@2048"]
        and results["dense@2048"]["workloads"]["decode:2x8"]["ratio"] == 1.0
    )
    table = (tmp_path / "vllm_speed.md").read_text()
    assert "| dense | 2048 | 2048 / 8192 | – | 3.00 | – | – | 100 |" in table


def test_vllm_speed_alternates_the_engines_and_takes_medians(tmp_path, monkeypatch):
    """Three rounds of dense then 2:4: each engine's tokens/s is the median of its rounds
    (one slow round does not move it), the ratio is of those medians, and the resident
    memory saved, as it is and with both engines' freed heap pages returned, is counted
    against the 2:4 layers' dense weight bytes."""
    import vllm_speed

    order, rates = [], {"dense": iter([100.0, 60.0, 110.0]), "2:4": iter([150.0, 160.0, 90.0])}

    def run_engine(command, out, timeout):
        label = command[command.index("--label") + 1].split()[0]
        order.append(label)
        dense = label == "dense"
        return engine_result(
            next(rates[label]), 3.0 if dense else 2.5, 2**30, 2.75 if dense else 2.5
        )

    monkeypatch.setattr(vllm_speed, "run_engine", run_engine)
    argv = [
        "--shape",
        "tiny",
        "--layers",
        "1",
        "--modes",
        "sparse",
        "--workloads",
        "decode:2x8",
        "--python",
        sys.executable,
        "--out",
        str(tmp_path),
    ]
    assert vllm_speed.main(argv) == 0
    assert order == ["dense", "2:4"] * 3
    results = json.loads((tmp_path / "vllm_speed.json").read_text())["results"]
    cell = results["2:4 sparse@0"]["workloads"]["decode:2x8"]
    assert cell["tokens_per_s"] == 150.0 and cell["ratio"] == 1.5
    assert results["2:4 sparse@0"]["rss_saved"] == 0.5
    assert results["2:4 sparse@0"]["rss_saved_trimmed"] == 0.25
    assert "| 2.50 | 0.50× | 0.25× | 150 (1.50×) |" in (tmp_path / "vllm_speed.md").read_text()


@pytest.mark.parametrize(
    ("flag", "mode", "shown"),
    [([], "DYNAMO_TRACE_ONCE", "compiled"), (["--enforce-eager"], "NONE", "eager")],
)
def test_vllm_speed_runs_the_engines_as_vllm_does_unless_told_eager(
    tmp_path, monkeypatch, flag, mode, shown
):
    """By default each engine runs as vLLM runs it (on a CPU: compiled by torch.compile, no
    enforce_eager); ``--enforce-eager`` runs them all eagerly; the table says which."""
    import vllm_speed
    from vllm_engine import Workload, engine_arguments
    from vllm_engine import parse_args as engine_options

    def run_engine(command, out, timeout):
        options = engine_options(command[2:])  # [python, vllm_engine.py, checkpoint, ...]
        engine = engine_arguments(options, [Workload.parse("decode:2x8")], on_gpu=False)
        assert engine["enforce_eager"] is bool(flag)
        result = engine_result(100.0, 3)
        result["graphs"] = {
            "max_cudagraph_capture_size": None,
            "max_num_batched_tokens": 80,
            "compilation_mode": mode,
        }
        return result

    monkeypatch.setattr(vllm_speed, "run_engine", run_engine)
    argv = [
        "--shape",
        "tiny",
        "--layers",
        "1",
        "--modes",
        "sparse",
        "--workloads",
        "decode:2x8",
        "--rounds",
        "1",
        "--python",
        sys.executable,
        "--out",
        str(tmp_path),
        *flag,
    ]
    assert vllm_speed.main(argv) == 0
    table = (tmp_path / "vllm_speed.md").read_text()
    assert (
        f"| dense | 0 | {shown} / 80 |" in table and f"| 2:4 sparse | 0 | {shown} / 80 |" in table
    )


def test_speed_benchmark_on_a_random_llama_shaped_model(tmp_path):
    import speed

    argv = [
        "--random-layers",
        "1",
        "--hidden",
        "64",
        "--intermediate",
        "128",
        "--num-sequences",
        "4",
        "--seq-len",
        "32",
        "--methods",
        "wisp",
        "sparsegpt",
        "--offload-devices",
        "cpu",
        "--batch-sizes",
        "1",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert speed.main(argv) == 0
    rows = json.loads((tmp_path / "speed_random.json").read_text())["rows"]
    pipelines = ["sequential", "whisper_layerwise"]  # both by default (issue 24)
    assert [(r["method"], r["pipeline"], r["batch_size"]) for r in rows] == [
        (method, pipeline, batch)
        for batch in (1, 2)
        for method in ("wisp", "sparsegpt")
        for pipeline in pipelines
    ]
    assert all(r["seconds"] > 0 and r["layer_target"] is None for r in rows)  # not 7B-shaped
    table = (tmp_path / "speed_random.md").read_text()
    assert "| wisp | whisper_layerwise | cpu | 2 |" in table
    for r in rows:  # the 32-layer extrapolation, in minutes, beside the peak memory
        minutes, gib = r["seconds_per_layer"] * 32 / 60, r["peak_bytes"] / 2**30
        assert f"| {minutes:.1f} | {gib:.1f} |" in table


def test_speed_benchmark_times_the_pipelines_and_compares_their_weights(tmp_path):
    import speed

    argv = [
        "--models",
        "stories260K",
        "--pairs",
        "pipeline",
        "--repeats",
        "1",
        "--only",
        "wanda@whisper_layerwise",
        "--num-sequences",
        "4",
        "--seq-len",
        "64",
        "--out",
        str(tmp_path),
    ]
    assert speed.main(argv) == 0
    (row,) = json.loads((tmp_path / "speed.json").read_text())["models"]["stories260K"]["ratios"]
    assert (row["baseline"], row["method"], row["time_target"]) == (
        "wanda",
        "wanda@whisper_layerwise",
        1.0,
    )
    assert row["same_weights"] is True  # eager attention on a CPU: llmcompressor's bits
    assert "| wanda@whisper_layerwise / wanda |" in (tmp_path / "speed.md").read_text()


def test_speed_benchmark_batch_effect(tmp_path):
    import speed

    argv = [
        "--batch-effect",
        "--models",
        "stories260K",
        "--methods",
        "whisper",
        "--batch-sizes",
        "1",
        "4",
        "--num-sequences",
        "8",
        "--seq-len",
        "64",
        "--out",
        str(tmp_path),
    ]
    assert speed.main(argv) == 0
    rows = json.loads((tmp_path / "speed_batch.json").read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 4] and rows[0]["mask_agreement"] == 1.0
    assert rows[1]["mask_agreement"] >= 0.999
    assert "| stories260K | whisper | 4 |" in (tmp_path / "speed_batch.md").read_text()


def test_reference_obs_solve_is_sparsegpts(tmp_path):
    """The reference's OBS solve (``reference_pruning.obs_prune``, our own code) equals
    llmcompressor's ``sparsify_weight`` on the same Hessian, bit for bit: N:M and
    unstructured (whose per-block threshold keeps its tie: a little over half pruned)."""
    from llmcompressor.modifiers.pruning.sparsegpt.sgpt_sparsify import sparsify_weight
    from reference_pruning import obs_prune

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 256, generator=generator)
    hessian = 2 / 300 * x.t() @ x
    linear = torch.nn.Linear(256, 48, bias=False)
    for prune_n, prune_m in ((2, 4), (0, 0)):
        mine = obs_prune(linear.weight.detach(), hessian, 0.5, prune_n, prune_m)
        stock = sparsify_weight(
            linear, {linear: hessian.clone()}, 0.5, prune_n, prune_m, 128, 0.01, False
        )
        assert torch.equal(mine, (stock[1] if isinstance(stock, tuple) else stock).detach())
        pruned = (mine == 0).float().mean()
        assert pruned == 0.5 if prune_n else 0.5 <= pruned < 0.51


def test_reference_wanda_is_the_stock_selection():
    """The reference's Wanda (one topk over every group) picks what our baseline's and
    llmcompressor's group-by-group selection picks."""
    from reference_pruning import wanda_prune

    from whisper_modifiers.solvers import prune_by_score, wanda_scores

    generator = torch.Generator().manual_seed(1)
    weight, norms = torch.randn(32, 64, generator=generator), torch.rand(64, generator=generator)
    for prune_n, prune_m in ((2, 4), (0, 0)):
        expected = prune_by_score(weight, wanda_scores(weight, norms.sqrt()), 0.5, prune_n, prune_m)
        assert torch.equal(wanda_prune(weight, norms, 0.5, prune_n, prune_m), expected)


def test_speed_benchmark_with_the_reference_and_a_profile(tmp_path):
    """--reference times the reference procedure on the same random model, every row gets
    its ratio to its reference against issue 50's target, and --profile writes one method's
    ops."""
    import speed

    argv = [
        "--random-layers",
        "1",
        "--hidden",
        "64",
        "--intermediate",
        "128",
        "--num-sequences",
        "2",
        "--seq-len",
        "16",
        "--methods",
        "wisp",
        "whisper",
        "--pipelines",
        "sequential",
        "--offload-devices",
        "cpu",
        "--reference",
        "--profile",
        "wisp",
        "--out",
        str(tmp_path),
    ]
    assert speed.main(argv) == 0
    rows = json.loads((tmp_path / "speed_random.json").read_text())["rows"]
    assert [r["method"] for r in rows] == [
        "reference wanda",
        "reference sparsegpt",
        "wisp",
        "whisper",
    ]
    assert [r["reference"] for r in rows[2:]] == ["reference wanda", "reference sparsegpt"]
    assert [r["reference_target"] for r in rows[2:]] == [1.2, 1.1]
    assert all(r["reference_ratio"] > 0 for r in rows[2:])
    table = (tmp_path / "speed_random.md").read_text()
    assert "| reference sparsegpt | reference | cpu | 1 |" in table
    assert "aten::" in (tmp_path / "profile_wisp.md").read_text()


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7])
def test_balanced_orders_give_every_side_every_place_and_every_predecessor(count):
    """Over one cycle of the orders each side is timed once a round, takes each place in the
    round equally often, and directly follows each other side equally often."""
    from collections import Counter

    from common import balanced_orders

    labels = [f"side{index}" for index in range(count)]
    orders = balanced_orders(labels)
    assert len(orders) == (count if count % 2 == 0 else 2 * count)
    assert all(sorted(order) == labels for order in orders)
    places = Counter((label, order.index(label)) for order in orders for label in order)
    assert set(places.values()) == {len(orders) // count}
    follows = Counter(pair for order in orders for pair in zip(order, order[1:], strict=False))
    if count > 1:
        assert len(follows) == count * (count - 1)  # every ordered pair of two sides
        assert len(set(follows.values())) == 1


def test_alternated_rounds_run_each_side_once_a_round_in_balanced_orders():
    """common.alternated_rounds: every round runs each side once, in that round's balanced
    order, and gives each side its seconds per round."""
    from common import alternated_rounds, balanced_orders

    ran = []
    sides = {label: (lambda label=label: ran.append(label)) for label in ("a", "b", "c")}
    seconds = alternated_rounds(sides, 8)
    orders = balanced_orders(["a", "b", "c"])
    assert ran == [label for round_ in range(8) for label in orders[round_ % len(orders)]]
    assert all(len(values) == 8 and min(values) >= 0 for values in seconds.values())
