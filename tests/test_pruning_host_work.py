"""Work on the host that grows with the model or the data, counted on a CPU with
``torch.profiler`` (issue 50: the GPU pruning run's time went to such work).

* The N:M selection of the no-update methods makes a fixed number of ``aten::topk`` calls
  per pruned module, whatever its input width (llmcompressor's Wanda calls it once per group
  of M columns).
* A ``oneshot`` run reads tensors into Python (``aten::_local_scalar_dense``: ``item``,
  ``bool``, ``int``) as often with 8 calibration sequences as with 4: no read per sequence
  (the finiteness of the calibration inputs is kept on their device and read once per
  layer, before solving)."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from conftest import CALIBRATION_TEXT, load_model, tiny_model

pytestmark = pytest.mark.slow


def op_calls(run, op: str) -> int:
    """How many times ``run()`` calls the aten ``op`` (on this thread, CPU)."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run()
    return sum(event.count for event in profiler.key_averages() if event.key == op)


def calibration_of(tokenizer, sequences: int):
    from whisper_modifiers.data import calibration_dataset

    text = CALIBRATION_TEXT.read_text(encoding="utf-8")[:100_000]
    return calibration_dataset(tokenizer, text, sequences, 64, seed=0)


def tiny_llama(directory, tokenizer, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256)  # fmt: skip
    return tiny_model(directory / f"llama{hidden}", tokenizer, LlamaForCausalLM, config)


@pytest.mark.parametrize("method", ["wanda", "wisp", "wisp_plus"])
def test_nm_selection_calls_topk_a_fixed_number_of_times_per_module(
    tmp_path, tokenizer, method
):  # fmt: skip
    from transformers import AutoModelForCausalLM

    from whisper_modifiers.methods import build_recipe, run_oneshot

    calibration = calibration_of(tokenizer, 4)
    per_module = {}
    for hidden in (64, 256):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama(tmp_path, tokenizer, hidden))
        recipe = build_recipe(method, 0.5, "2:4")
        calls = op_calls(lambda m=model, r=recipe: run_oneshot(m, tokenizer, calibration, r),
                         "aten::topk")  # fmt: skip
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
            "aten::_local_scalar_dense")  # fmt: skip
    assert reads[4] == reads[8], reads
