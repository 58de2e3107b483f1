"""The serving driver's worker processes, without vLLM: a worker that a signal kills or
that runs past its limit is reported by how it ended and its last lines, and a candidate
dtype whose probe process dies is a refusal of that dtype only. The stand-in for the
serving environment's Python is a small script; the real one is tested in
test_serving.py."""

from __future__ import annotations

import json
import stat
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from whisper_sparse.cpu.fp8 import dequantized_fp8_weight
from whisper_sparse.driver.probe import probe_dtypes
from whisper_sparse.driver.worker_process import (
    RESULT_PREFIX,
    WorkerFailed,
    exit_description,
    run_worker,
)


def fake_python(path, body: str):
    """An executable standing in for the serving environment's Python: it is called as
    ``python -c CODE REQUEST.json`` and runs ``body`` with ``request`` (the parsed JSON)
    and ``log`` (a file of the requests it saw) in scope."""
    log = path.with_suffix(".log")
    path.write_text(
        f"#!{sys.executable}\n"
        "import json, os, signal, sys, time\n"
        "request = json.load(open(sys.argv[-1]))\n"
        f"log = open({str(log)!r}, 'a')\n"
        "log.write(json.dumps(request.get('dtype')) + '\\n'); log.close()\n" + textwrap.dedent(body)
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path, log


def test_exit_description_names_the_signal():
    assert exit_description(1) == "exit 1"
    assert exit_description(-6) == "killed by SIGABRT (exit -6)"
    assert exit_description(-9) == "killed by SIGKILL (exit -9)"


def test_a_worker_killed_by_a_signal_is_reported_with_its_name_and_last_lines(tmp_path):
    python, _ = fake_python(
        tmp_path / "python",
        """
        print("loading the engine", flush=True)
        print("terminate called recursively", file=sys.stderr, flush=True)
        os.abort()
    """,
    )
    with pytest.raises(WorkerFailed, match=r"vLLM failed \(killed by SIGABRT \(exit -6\)\)") as e:
        run_worker({"model": "m"}, python, timeout=60)
    assert e.value.ending == "killed by SIGABRT (exit -6)"
    assert "loading the engine" in e.value.tail and "terminate called recursively" in e.value.tail


def test_a_worker_past_its_limit_is_stopped_with_its_last_lines(tmp_path):
    python, _ = fake_python(
        tmp_path / "python",
        """
        print("scoring 4 x 256 tokens", flush=True)
        time.sleep(60)
    """,
    )
    with pytest.raises(WorkerFailed, match=r"stopped after 2 s") as e:
        run_worker({"model": "m"}, python, timeout=2)
    assert "scoring 4 x 256 tokens" in e.value.tail


def test_a_worker_that_exits_without_an_answer_is_reported(tmp_path):
    python, _ = fake_python(
        tmp_path / "python",
        """
        print("RuntimeError: int8_scaled_mm_with_quant: expect A to be bfloat16 or half")
        sys.exit(1)
    """,
    )
    with pytest.raises(WorkerFailed, match=r"\(exit 1\); its last lines:\nRuntimeError: int8"):
        run_worker({"model": "m"}, python, timeout=60)


def served_checkpoint(directory):
    """A quantized checkpoint that ``check_checkpoint`` accepts (weights, config, tokenizer
    file); its values are never run (the serving Python is a stand-in)."""
    config = quantized_checkpoint(directory)
    config.update(
        architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=2048
    )
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text("{}")
    return directory


def quantized_checkpoint(directory):
    directory.mkdir()
    save_file(
        {
            "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 16, dtype=torch.int8),
            "model.layers.0.mlp.up_proj.weight_scale": torch.ones(8, 1),
        },
        directory / "model.safetensors",
    )
    return {"quantization_config": {"config_groups": {"group_0": {"targets": ["Linear"]}}}}


def test_a_dtype_whose_probe_process_dies_is_refused_and_the_next_one_is_tried(tmp_path):
    """As on AMX CPUs, where float16 can end the process with a C++ terminate: that dtype
    alone is refused, and the probe goes on to the next candidate, then stops at the
    first one accepted."""
    config = quantized_checkpoint(tmp_path / "ckpt")
    python, log = fake_python(
        tmp_path / "python",
        f"""
        dtype = request["dtype"]
        assert request["probe"] and request["prefill_tokens"] >= 256 and request["decode_batch"] > 1
        if dtype == "float16":
            os.abort()
        accepted = [dtype] if dtype == "bfloat16" else []
        errors = {{}} if accepted else {{dtype: "RuntimeError: A"}}
        print({RESULT_PREFIX!r} + json.dumps({{"accepted": accepted, "errors": errors,
              "missing_ops": [], "kernels": {{"up": "K"}}, "emulated_fp8": False,
              "resolved": {{dtype: dtype}}}}))
    """,
    )
    candidates = ["float32", "float16", "bfloat16", "half"]
    answer = probe_dtypes(tmp_path / "ckpt", config, candidates, python)
    assert answer["dtype"] == "bfloat16" and answer["kernels"] == {"up": "K"}
    assert answer["errors"]["float32"] == "RuntimeError: A"
    assert answer["errors"]["float16"].startswith("the process ended (killed by SIGABRT")
    # one process per candidate, none after the first accepted
    tried = [json.loads(line) for line in log.read_text().splitlines()]
    assert tried == ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("amx", [True, False])
def test_an_illegal_instruction_names_amx_where_the_cpu_has_it(tmp_path, monkeypatch, amx):
    """The AMX machine's failure: the probe accepted nothing, each candidate's process died
    with SIGILL. On a CPU with AMX the refusal says AMX is not usable here, or capped (and
    names the cap); elsewhere it names the signal. Serving is refused before any server
    starts (``serving_plan`` raises ``ServingUnavailable``, whisper-serve exits 2)."""
    from whisper_sparse.driver import probe

    flags = {"avx2", "avx512f"} | ({"amx_tile", "amx_int8", "amx_bf16"} if amx else set())
    monkeypatch.setattr(probe, "cpu_flag_set", lambda: flags)
    monkeypatch.setattr(probe, "on_cpu", lambda: True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("WHISPER_MODIFIERS_CACHE", str(tmp_path / "cache"))
    ckpt = served_checkpoint(tmp_path / "ckpt")
    python, log = fake_python(tmp_path / "python", "os.kill(os.getpid(), signal.SIGILL)\n")
    with pytest.raises(probe.ServingUnavailable) as refused:
        probe.serving_plan(ckpt, python)
    message = str(refused.value)
    assert "in any of auto, bfloat16, float16" in message
    if amx:
        assert (
            message.count(
                "AMX present but not usable in this process, or capped (ONEDNN_MAX_CPU_ISA=AVX2)"
            )
            == 3
        )
    else:
        assert "AMX" not in message and message.count("(SIGILL)") == 3
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        "auto",
        "bfloat16",
        "float16",
    ]
    from whisper_sparse.driver.cli import main as whisper_serve

    assert whisper_serve([str(ckpt), "--dry-run", "--python", str(python)]) == 2


def test_the_plugin_asks_for_amx_where_the_cpu_has_it():
    """``request_amx`` (called by the vLLM plugin in every vLLM process): on a CPU with AMX
    the OS grants the tile state here (True; False would be a VM or container refusing
    it), elsewhere there is nothing to ask (None). Decided from the CPU's flags, so it
    holds on either kind of CI machine."""
    from whisper_sparse.driver.probe import AMX_FLAGS, cpu_flag_set
    from whisper_sparse.vllm_adapter.plugin import request_amx

    assert request_amx() is (True if "amx_tile" in cpu_flag_set() & AMX_FLAGS else None)


def test_vllms_warning_per_cast_weight_becomes_one_line():
    """vLLM's loader warns once per tensor whose dtype differs from the served one (62
    lines for SmolLM2 in bfloat16); the plugin's filter says it once, naming both dtypes,
    and lets every other record through."""
    import logging

    from whisper_sparse.vllm_adapter.plugin import CastNote

    note = CastNote()

    def record(message, *args):
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, message, args, None)

    cast = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    first = record(cast, "model.embed_tokens.weight", torch.float32, torch.bfloat16)
    assert note.filter(first)
    assert first.getMessage() == (
        "the checkpoint's float32 weights are cast to bfloat16 as "
        "they load (vLLM's --dtype); this is said once for all of "
        "them"
    )
    assert not note.filter(record(cast, "lm_head.weight", torch.float32, torch.bfloat16))
    other = record("Loading weights took %.2f seconds", 1.5)
    assert note.filter(other) and other.getMessage() == "Loading weights took 1.50 seconds"


def test_missing_ops_stop_the_probe(tmp_path):
    config = quantized_checkpoint(tmp_path / "ckpt")
    python, log = fake_python(
        tmp_path / "python",
        f"""
        print({RESULT_PREFIX!r} + json.dumps({{"accepted": [], "errors": {{}},
              "missing_ops": ["cpu_gemm_wna16"]}}))
    """,
    )
    answer = probe_dtypes(tmp_path / "ckpt", config, ["float32", "bfloat16"], python)
    assert answer["dtype"] is None and answer["missing_ops"] == ["cpu_gemm_wna16"]
    assert len(log.read_text().splitlines()) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_fp8_weight_is_scale_times_value(dtype):
    """Per output channel, per fused part and per tensor, against a loop over rows."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(12, 8, generator=generator) * 50).to(torch.float8_e4m3fn)
    widths = [4, 8]
    channel = torch.rand(12, 1, generator=generator) + 0.01
    parts = torch.rand(2, generator=generator) + 0.01
    tensor = torch.rand(1, generator=generator) + 0.01
    for scale, per_row in [
        (channel, [float(channel[i, 0]) for i in range(12)]),
        (parts, [float(parts[0])] * 4 + [float(parts[1])] * 8),
        (tensor, [float(tensor[0])] * 12),
    ]:
        expected = torch.stack([weight[i].to(torch.float32) * per_row[i] for i in range(12)])
        got = dequantized_fp8_weight(weight, scale, widths, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, expected.to(dtype))
    with pytest.raises(ValueError, match="neither per channel, per fused part nor per tensor"):
        dequantized_fp8_weight(weight, torch.ones(5), widths, dtype)
