"""Work on the host that grows with the model or the data, counted on a CPU (issue 50: the
GPU pruning run's time went to such work).

Calls are counted by a ``TorchDispatchMode`` (every aten op that reaches a kernel from this
thread), not ``torch.profiler``: the profiler made a stories260K ``oneshot`` about 30x
slower (0.6 s to 19 s).

* The N:M selection of the no-update methods makes a fixed number of ``aten::topk`` calls
  per pruned module, whatever its input width (llmcompressor's Wanda calls it once per group
  of M columns).
* A ``oneshot`` run reads tensors into Python (``aten::_local_scalar_dense``: ``item``,
  ``bool``, ``int``) as often with 8 calibration sequences as with 4: no read per sequence
  (the finiteness of the calibration inputs is kept on their device and read once per
  layer, before solving)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import CALIBRATION_TEXT, load_model, tiny_model

pytestmark = pytest.mark.slow


class OpCounter(TorchDispatchMode):
    """Counts the calls of one aten op (``aten::topk``: every overload) on this thread."""

    def __init__(self, op: str):
        super().__init__()
        self.packet, self.calls = getattr(torch.ops.aten, op.removeprefix("aten::")), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket is self.packet
        return func(*args, **(kwargs or {}))


def op_calls(run, op: str) -> int:
    """How many times ``run()`` calls the aten ``op`` (on this thread)."""
    with OpCounter(op) as counter:
        run()
    return counter.calls


def test_the_counter_sees_reads_and_topk_calls():
    values = torch.arange(12.0).reshape(3, 4)
    assert op_calls(lambda: [float(row.sum()) for row in values], "aten::_local_scalar_dense") == 3
    assert op_calls(lambda: [values.topk(2, dim=1) for _ in range(5)], "aten::topk") == 5


def calibration_of(tokenizer, sequences: int):
    from whisper_modifiers.data import calibration_dataset

    text = CALIBRATION_TEXT.read_text(encoding="utf-8")[:100_000]
    return calibration_dataset(tokenizer, text, sequences, 64, seed=0)


def tiny_llama(directory, tokenizer, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return tiny_model(directory / f"llama{hidden}", tokenizer, LlamaForCausalLM, config)


@pytest.mark.parametrize("method", ["wanda", "wisp", "wisp_plus"])
def test_nm_selection_calls_topk_a_fixed_number_of_times_per_module(tmp_path, tokenizer, method):
    from transformers import AutoModelForCausalLM

    from whisper_modifiers.methods import build_recipe, run_oneshot

    calibration = calibration_of(tokenizer, 4)
    per_module = {}
    for hidden in (64, 256):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama(tmp_path, tokenizer, hidden))
        recipe = build_recipe(method, 0.5, "2:4")
        calls = op_calls(
            lambda m=model, r=recipe: run_oneshot(m, tokenizer, calibration, r), "aten::topk"
        )
        per_module[hidden] = calls / 7  # q, k, v, o, gate, up, down
    assert per_module[64] == per_module[256], per_module
    assert per_module[64] <= 4, per_module


@pytest.mark.parametrize("method", ["whisper", "wisp_plus", "wisp", "wanda", "sparsegpt"])
def test_a_oneshot_run_reads_no_tensor_per_calibration_sequence(tokenizer, method):
    from whisper_modifiers.methods import build_recipe, run_oneshot

    reads = {}
    for sequences in (4, 8):
        model, calibration = load_model(), calibration_of(tokenizer, sequences)
        recipe = build_recipe(method, 0.5, "2:4")
        reads[sequences] = op_calls(
            lambda m=model, c=calibration, r=recipe: run_oneshot(m, tokenizer, c, r),
            "aten::_local_scalar_dense",
        )
    assert reads[4] == reads[8], reads
