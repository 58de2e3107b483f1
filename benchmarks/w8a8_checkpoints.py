"""Random-weight Llama checkpoints pruned by magnitude and quantized W8A8 by llmcompressor in
one recipe, stored compressed, for the vLLM speed benchmarks' W8A8 engines.

``build_w8a8_checkpoints`` writes the dense bf16 model (every decoder Linear 2:4 by
magnitude, zeros stored, as ``vllm_speed.build_checkpoints``) and, per sparsity, what
``oneshot`` with ``OneShotMagnitudeModifier`` then ``QuantizationModifier(scheme="W8A8")``
saves (``lm_head`` kept bf16, as the recipes do): 2:4 in the 2:4 layout, an unstructured
sparsity (new random values) in the bitmask layout, both holding int8 values. Dense W8A8 is
the first of them served decompressed (kernel mode ``dense``): the same int8 weights in
vLLM's dense W8A8 layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pruned_models import decoder_linear_names, pruned_llama  # noqa: E402
from vllm_speed_report import sparsity_label  # noqa: E402

DENSE_W8A8 = "dense W8A8"


def w8a8_label(sparsity: str) -> str:
    return f"{sparsity_label(sparsity)} W8A8"


def w8a8_recipe(sparsity: str) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from whisper_modifiers.modifiers import OneShotMagnitudeModifier

    if sparsity == "2:4":
        pruning = {"sparsity": 0.5, "mask_structure": "2:4"}
    else:
        pruning = {"sparsity": float(sparsity)}
    return [
        OneShotMagnitudeModifier(**pruning, targets=["Linear"], ignore=["lm_head"]),
        QuantizationModifier(targets=["Linear"], scheme="W8A8", ignore=["lm_head"]),
    ]


def build_w8a8_checkpoints(
    root: Path, shape: str, layers: int, sparsities: list[str]
) -> tuple[dict[str, Path], dict[str, str]]:
    """The checkpoints keyed ``dense``, ``dense W8A8`` and ``w8a8_label(sparsity)``, and
    the kernel mode of those not served in the run's own (``dense W8A8``: ``dense``)."""
    import torch
    from llmcompressor import oneshot

    torch.manual_seed(0)
    model = pruned_llama(layers, torch.bfloat16, shape, "cpu")
    paths = {"dense": root / "dense"}
    model.save_pretrained(paths["dense"])
    for sparsity in sparsities:
        label = w8a8_label(sparsity)
        source = paths["dense"]
        if sparsity != "2:4":
            with torch.no_grad():
                for name in decoder_linear_names(model):
                    weight = model.get_submodule(name).weight
                    weight.copy_(torch.randn_like(weight) * 0.02)
            source = root / f"source-{sparsity}"
            model.save_pretrained(source)
        quantized = oneshot(model=str(source), recipe=w8a8_recipe(sparsity))
        paths[label] = root / label.replace(":", "of").replace("%", "pct").replace(" ", "-")
        quantized.save_pretrained(paths[label], save_compressed=True)
        del quantized
    paths[DENSE_W8A8] = paths[w8a8_label(sparsities[0])]
    return paths, {DENSE_W8A8: "dense"}
