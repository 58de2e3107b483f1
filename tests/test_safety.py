"""Bad and edge inputs to the command-line tools (stories260K): nothing the user owns is
ever deleted, every bad input is refused before the weights load with the flag's name,
numerical faults stop the run, and no leftovers or unreadable checkpoints are made."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import CALIBRATION_TEXT, HELDOUT_TEXT, MODEL_DIR, REPO
from whisper_modifiers import output_dir as output_dir_module
from whisper_modifiers.cli import main as whisper_prune
from whisper_modifiers.diagnose_cli import main as whisper_diagnose
from whisper_modifiers.methods import METHODS
from whisper_modifiers.modifiers.validation import NonFiniteError
from whisper_modifiers.output_dir import partial_output, remove_stale_partials
from whisper_sparse.driver.cli import main as whisper_serve
from whisper_sparse.format.checkpoint import LOCK_FILE, RECORD_FILE, REPORT_FILE, check_checkpoint

DATA = ["--num-sequences", "4", "--seq-len", "64", "--eval-seq-len", "128", "--eval-windows", "2"]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the hash of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def workspace(tmp_path):
    """A user's directory: own files, a copy of the source model, the data files."""
    root = tmp_path / "work"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "thesis.tex").write_text("my thesis\n")
    (root / "results.csv").write_text("a,b\n1,2\n")
    model = root / "models" / "stories260K"
    shutil.copytree(MODEL_DIR, model)
    for path in model.iterdir():
        path.chmod(0o644)  # the shared copy is read-only
    shutil.copy(CALIBRATION_TEXT, root / "calibration.txt")
    shutil.copy(HELDOUT_TEXT, root / "eval.txt")
    return root


def argv(root: Path, output, *extra, model=None):
    return [
        "--model",
        str(model or root / "models" / "stories260K"),
        "--calibration",
        str(root / "calibration.txt"),
        "--eval-text",
        str(root / "eval.txt"),
        *DATA,
        "--skip-dense-eval",
        "--recipe",
        "wanda_2of4",
        "--output-dir",
        str(output),
        *extra,
    ]


def sentinel_model(directory: Path) -> Path:
    """stories260K's config and tokenizer with a weights file that cannot load: a run
    refused with exit code 2 and our message was refused before loading the weights."""
    directory.mkdir(parents=True)
    for path in MODEL_DIR.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, directory / path.name)
    (directory / "model.safetensors").write_bytes(b"sentinel: loading this must fail")
    return directory


# -- output safety -------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_directory_that_is_not_ours_is_never_replaced(workspace, capsys, overwrite):
    before = snapshot(workspace)
    assert whisper_prune(argv(workspace, workspace / "notes", *overwrite)) == 2
    err = capsys.readouterr().err
    assert "--output-dir" in err and "thesis.tex" in err and "not written by whisper-prune" in err
    assert snapshot(workspace) == before


@pytest.mark.parametrize(
    "target",
    ["cwd", "home", "root", "model", "model_parent", "data_parent"],
)
def test_protected_directories_are_refused(workspace, capsys, monkeypatch, target):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("HOME", str(workspace / "notes"))
    path = {
        "cwd": Path("."),
        "home": Path("~"),
        "root": Path("/"),
        "model": workspace / "models" / "stories260K",
        "model_parent": workspace / "models",
        "data_parent": workspace,
    }[target]
    before = snapshot(workspace)
    assert whisper_prune(argv(workspace, path, "--overwrite")) == 2
    assert "--output-dir" in capsys.readouterr().err
    assert snapshot(workspace) == before


def test_only_our_checkpoint_is_replaced_and_only_with_overwrite(workspace, capsys):
    out = workspace / "ckpt"
    assert whisper_prune(argv(workspace, out)) == 0
    first = snapshot(out)
    assert whisper_prune(argv(workspace, out)) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert snapshot(out) == first
    assert whisper_prune(argv(workspace, out, "--overwrite", "--seed", "1")) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["calibration"]["seed"] == 1
    assert sorted(p.name for p in workspace.iterdir()) == sorted(
        ["notes", "results.csv", "models", "calibration.txt", "eval.txt", "ckpt"]
    )  # no partial or replaced directory left beside it


def test_empty_output_directory_is_used(workspace):
    (workspace / "empty").mkdir()
    assert whisper_prune(argv(workspace, workspace / "empty")) == 0
    check_checkpoint(workspace / "empty")


def test_checkpoints_get_the_umask_permissions(workspace):
    previous = os.umask(0o022)
    try:
        assert whisper_prune(argv(workspace, workspace / "ckpt")) == 0
    finally:
        os.umask(previous)
    assert (workspace / "ckpt").stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in (workspace / "ckpt").iterdir()} == {0o644}


def test_replace_never_loses_both_checkpoints(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old").write_text("old checkpoint")
    real_replace = os.replace

    def failing_replace(src, dst):  # renaming the new checkpoint into place fails
        if ".partial-" in Path(src).name:
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(output_dir_module.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        with partial_output(target) as partial:
            (partial / "new").write_text("new checkpoint")
    assert [p.name for p in target.iterdir()] == ["old"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # partial and aside removed


# -- fail fast, with the flag's name, before the weights load ------------------------


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("case", "flag", "message"),
    [
        ("calibration_missing", "--calibration", "neither a readable file"),
        ("calibration_binary", "--calibration", "not UTF-8"),
        ("calibration_empty", "--calibration", "holds no text"),
        ("calibration_short", "--calibration", "needs at least 65"),
        ("eval_short", "--eval-text", "needs at least 128"),
        ("eval_windows", "--eval-windows", "at least 0"),
        ("num_sequences", "--num-sequences", "at least 1"),
        ("seq_len", "--seq-len", "at least 2"),
        ("eval_seq_len", "--eval-seq-len", "at least 2"),
        ("seed", "--seed", "at least 0"),
        ("positions", "--seq-len", "max_position_embeddings (512)"),
        ("recipe_empty", "--recipe", "is empty"),
        ("recipe_no_modifier", "--recipe", "defines no modifier"),
        ("recipe_seed", "--recipe", "seed"),
        ("difference_targets", "--recipe", "matches none"),
        ("output_file", "--output-dir", "not a directory"),
        ("output_under_file", "--output-dir", "which is a file"),
        ("output_unwritable", "--output-dir", "permission denied"),
        ("config_corrupt", "--model", "config.json is not valid JSON"),
    ],
)
def test_bad_input_fails_fast_with_the_flag(tmp_path, capsys, monkeypatch, case, flag, message):
    model = sentinel_model(tmp_path / "model")
    calibration = _write(tmp_path / "calibration.txt", CALIBRATION_TEXT.read_bytes()[:20000])
    evaluation = _write(tmp_path / "eval.txt", HELDOUT_TEXT.read_bytes())
    out = tmp_path / "out"
    options = {
        "--model": str(model),
        "--calibration": str(calibration),
        "--eval-text": str(evaluation),
        "--recipe": "wisp_2of4",
        "--output-dir": str(out),
        "--num-sequences": "4",
        "--seq-len": "64",
        "--eval-seq-len": "128",
        "--eval-windows": "2",
        "--seed": "0",
    }
    recipe = tmp_path / "recipe.yaml"
    if case == "calibration_missing":
        options["--calibration"] = str(tmp_path / "nope.txt")
    elif case == "calibration_binary":
        _write(calibration, bytes(range(256)) * 40)
    elif case == "calibration_empty":
        _write(calibration, b"  \n")
    elif case == "calibration_short":
        _write(calibration, b"Once upon a time.")
    elif case == "eval_short":
        _write(evaluation, b"The end.")
    elif case in ("eval_windows", "num_sequences", "seq_len", "eval_seq_len", "seed"):
        options["--" + case.replace("_", "-")] = {
            "eval_windows": "-2",
            "num_sequences": "0",
            "seq_len": "1",
            "eval_seq_len": "1",
            "seed": "-1",
        }[case]
    elif case == "positions":
        options["--seq-len"] = "1024"
    elif case in ("recipe_empty", "recipe_no_modifier", "recipe_seed", "difference_targets"):
        recipe.write_text(
            {
                "recipe_empty": "\n",
                "recipe_no_modifier": "s:\n  m:\n    WispModifier:\n      sparsity: 0.5\n",
                "recipe_seed": "s_stage:\n  s_modifiers:\n    WispModifier:\n"
                "      sparsity: 0.5\n      seed: -1\n",
                "difference_targets": "s_stage:\n  s_modifiers:\n    WispModifier:\n"
                "      sparsity: 0.5\n"
                "      difference_targets: ['re:.*mlp\\.nope_proj$']\n",
            }[case]
        )
        options["--recipe"] = str(recipe)
    elif case == "output_file":
        _write(out, b"a file")
    elif case == "output_under_file":
        _write(tmp_path / "file", b"a file")
        options["--output-dir"] = str(tmp_path / "file" / "out")
    elif case == "output_unwritable":  # root may write anywhere: ask as a user would be
        monkeypatch.setattr(output_dir_module.os, "access", lambda path, mode: False)
    elif case == "config_corrupt":
        _write(model / "config.json", b'{"architectures": ["LlamaForCausalLM"],')
    before = snapshot(tmp_path)
    assert whisper_prune([item for pair in options.items() for item in pair]) == 2
    err = capsys.readouterr().err
    assert err.startswith("whisper-prune: error: "), err
    assert flag in err and message in err, err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before


def exit_code(cli, args) -> int:
    try:
        return cli(args)
    except SystemExit as exit_info:  # argparse's parser.error
        return exit_info.code


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sparsities", "1.5"], "--sparsities must lie in [0, 1)"),
        (["--sparsities", "-0.5"], "--sparsities must lie in [0, 1)"),
        (["--gammas", "1.5"], "--gammas must lie in [0, 1]"),
        (["--seed", "-1"], "--seed must be at least 0"),
        (["--module", "model.layers.0.mlp"], "a LlamaMLP, not a Linear"),
        (["--module", "model.layers.9.mlp.gate_proj"], "is no module"),
    ],
)
def test_bad_diagnose_input_fails_fast(tmp_path, capsys, extra, message):
    model = sentinel_model(tmp_path / "model")
    args = [
        "--model",
        str(model),
        "--calibration",
        str(CALIBRATION_TEXT),
        "--out",
        str(tmp_path / "d"),
        *extra,
    ]
    assert exit_code(whisper_diagnose, args) == 2
    err = capsys.readouterr().err
    assert "whisper-diagnose: error: " in err and message in err, err
    if extra[0] == "--module":  # the valid names are listed
        assert "model.layers.{i}.mlp.gate_proj" in err and "(i = 0..4)" in err
    assert not (tmp_path / "d").exists()


def test_bad_serve_input_is_refused(tmp_path, capsys):
    assert exit_code(whisper_serve, [str(MODEL_DIR), "--port", "99999", "--dry-run"]) == 2
    assert "--port must lie in 1..65535" in capsys.readouterr().err
    assert exit_code(whisper_serve, [str(MODEL_DIR), "--dtype", "float99", "--dry-run"]) == 2
    assert "argument --dtype: invalid choice: 'float99'" in capsys.readouterr().err
    with socket.socket() as busy:  # a port already in use, refused before vLLM starts
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert exit_code(whisper_serve, [str(MODEL_DIR), "--port", port]) == 2
        assert f"--port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err

    corrupt = tmp_path / "corrupt"
    shutil.copytree(MODEL_DIR, corrupt)
    (corrupt / "config.json").chmod(0o644)
    (corrupt / "config.json").write_text("{not json")
    assert whisper_serve([str(corrupt), "--dry-run"]) == 2
    assert f"{corrupt / 'config.json'} is not valid JSON" in capsys.readouterr().err

    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(MODEL_DIR / name, no_tokenizer / name)
    assert whisper_serve([str(no_tokenizer), "--dry-run"]) == 2
    assert "no tokenizer" in capsys.readouterr().err

    no_record = tmp_path / "no_record"
    shutil.copytree(MODEL_DIR, no_record)
    (no_record / REPORT_FILE).write_text("{}")
    assert whisper_serve([str(no_record), "--dry-run"]) == 2
    assert f"{RECORD_FILE} is missing" in capsys.readouterr().err

    partial = tmp_path / ".ckpt.partial-abc123"
    shutil.copytree(MODEL_DIR, partial)
    assert whisper_serve([str(partial), "--dry-run"]) == 2
    assert "unfinished whisper-prune output" in capsys.readouterr().err


@pytest.mark.parametrize("method", [m for m, cls in METHODS.items() if "seed" in cls.model_fields])
def test_every_modifier_refuses_a_negative_seed(method):
    with pytest.raises(ValueError, match="seed"):
        METHODS[method](sparsity=0.5, seed=-1)


# -- numerical faults -----------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path_factory.mktemp("nan") / "model"
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight[3, 5] = float("nan")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(MODEL_DIR).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "recipe",
    [
        "magnitude_2of4",
        "ria_2of4",
        "wanda_2of4",
        "sparsegpt_2of4",
        "wisp_2of4",
        "whisper_2of4",
    ],
)
def test_nan_weights_are_refused_before_pruning(nan_model, tmp_path, capsys, recipe):
    out = tmp_path / "out"
    args = [
        "--model",
        str(nan_model),
        "--calibration",
        str(CALIBRATION_TEXT),
        "--eval-text",
        str(HELDOUT_TEXT),
        *DATA,
        "--recipe",
        recipe,
        "--output-dir",
        str(out),
    ]
    assert whisper_prune(args) == 2
    err = capsys.readouterr().err
    assert "model.layers.2.mlp.up_proj.weight holds 1 NaN or inf" in err
    assert not out.exists()


@pytest.mark.parametrize("method", ["ria", "wisp", "whisper"])
def test_nan_activations_stop_calibration_with_the_module(run_oneshot, method):
    from conftest import load_model
    from whisper_modifiers.methods import build_recipe

    model = load_model()

    def poison(module, args, output):
        return torch.full_like(output, float("nan"))

    model.model.layers[1].post_attention_layernorm.register_forward_hook(poison)
    with pytest.raises(NonFiniteError, match=r"model\.layers\.1\.mlp\.(gate|up)_proj received"):
        run_oneshot(build_recipe(method, 0.5, "2:4"), model=model)


def test_nan_pruned_perplexity_is_an_error_not_a_checkpoint(workspace, capsys, monkeypatch):
    import whisper_modifiers.evaluation as evaluation

    real = evaluation.perplexity
    calls = []

    def perplexity(*args, **kwargs):
        calls.append(1)
        return float("nan") if len(calls) == 2 else real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "perplexity", perplexity)
    args = [a for a in argv(workspace, workspace / "ckpt") if a != "--skip-dense-eval"]
    assert whisper_prune(args) == 1
    assert "perplexity is nan" in capsys.readouterr().err
    assert not (workspace / "ckpt").exists()
    assert not [p for p in workspace.iterdir() if p.name.startswith(".ckpt")]


# -- leftovers --------------------------------------------------------------------------

_KILLED_DURING_SAVE = """
import signal, sys, time
import whisper_modifiers.checkpoint as checkpoint
from whisper_modifiers.cli import main

# Ctrl-C's KeyboardInterrupt, as in a terminal: a command a shell without job control
# starts in the background (`cmd &`, as CI may be run) inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)

def write_record(directory, record):  # the signal arrives in the middle of saving
    # to this thread (os.kill's could go to a torch thread: SIGINT's KeyboardInterrupt then
    # waits for the main thread's sleep to end)
    signal.raise_signal(getattr(signal, sys.argv[1]))
    time.sleep(30)
    raise SystemExit("NOT STOPPED: the signal did not stop the save")

checkpoint.write_record = write_record
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(("signal_name", "code"), [("SIGTERM", 143), ("SIGINT", None)])
def test_signal_during_save_leaves_nothing(workspace, signal_name, code):
    out = workspace / "ckpt"
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_DURING_SAVE, signal_name, *argv(workspace, out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode != 0 and (code is None or done.returncode == code), done.stderr[-2000:]
    assert "NOT STOPPED" not in done.stderr, done.stderr[-2000:]
    assert not out.exists()
    assert not [p for p in workspace.iterdir() if p.name.startswith(".ckpt")]


def test_stale_partials_are_removed_but_not_live_or_newer_ones(workspace):
    out = workspace / "ckpt"
    stale, live, newer, other = (
        workspace / f".{name}.partial-{suffix}"
        for name, suffix in [("ckpt", "a"), ("ckpt", "b"), ("ckpt", "c"), ("other", "d")]
    )
    for directory in (stale, live, newer, other):
        directory.mkdir()
        (directory / LOCK_FILE).touch()
        (directory / "model.safetensors").write_bytes(b"half")
    old = time.time() - 3600
    for directory in (stale, live, other):
        os.utime(directory, (old, old))
    os.utime(newer, (time.time() + 3600, time.time() + 3600))
    with open(live / LOCK_FILE) as held:  # a run still writing it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert remove_stale_partials(out) == [stale]
    assert not stale.exists() and live.exists() and newer.exists() and other.exists()
    assert whisper_prune(argv(workspace, out)) == 0  # a run cleans what it may, too
    assert not live.exists() and newer.exists() and other.exists()


def test_serving_refuses_what_a_killed_run_left(workspace):
    partial = workspace / ".ckpt.partial-xyz"
    shutil.copytree(workspace / "models" / "stories260K", partial)
    with pytest.raises(ValueError, match="unfinished whisper-prune output"):
        check_checkpoint(partial)
    check_checkpoint(partial, unfinished_ok=True)


def prune_argv(output: Path, model: Path = MODEL_DIR) -> list[str]:
    return [
        "--model",
        str(model),
        "--recipe",
        "wanda_2of4",
        "--calibration",
        str(CALIBRATION_TEXT),
        "--eval-text",
        str(HELDOUT_TEXT),
        *DATA,
        "--skip-dense-eval",
        "--output-dir",
        str(output),
    ]


def test_a_model_directory_without_weights_is_refused(tmp_path, capsys):
    empty = tmp_path / "model"
    empty.mkdir()
    shutil.copy(MODEL_DIR / "config.json", empty / "config.json")
    assert whisper_prune(prune_argv(tmp_path / "o", empty)) == 2
    assert f"model directory {empty} has no weights" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_symlink_loop_as_output_is_refused(tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    assert whisper_prune(prune_argv(loop)) == 2
    assert f"--output-dir {str(loop)!r} cannot be resolved" in capsys.readouterr().err


def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    import whisper_modifiers.checkpoint as checkpoint_module

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "o"))

    monkeypatch.setattr(checkpoint_module, "strict_json", full)
    assert whisper_prune(prune_argv(tmp_path / "o")) == 1
    assert "no space left on the device while writing the checkpoint" in (capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no partial
