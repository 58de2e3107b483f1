"""Which modules a difference modifier prunes, and which of them get the difference
statistic: llmcompressor's selection with clean names, and ``difference_targets``."""

from __future__ import annotations

import torch
from compressed_tensors.utils import match_named_modules, match_targets
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_base import PRUNABLE_LAYER_TYPES

from whisper_modifiers.modifiers.validation import check_structure_divides, parse_mask_structure

__all__ = [
    "DEFAULT_DIFFERENCE_TARGETS",
    "DEFAULT_IGNORE",
    "pruned_modules",
    "select_difference_modules",
]

# the gate and up inputs of every gated MLP in transformers' families: separate (Llama,
# Qwen, Mistral, Gemma, ...) or fused into one Linear (Phi-3's gate_up_proj, Granite's
# shared input_linear: the same inputs, so the same statistic), LFM2's w1 / w3, MoE experts
# as llmcompressor runs them (experts.N.gate_proj) and shared experts; never a router
DEFAULT_DIFFERENCE_TARGETS = [
    r"re:.*((mlp|feed_forward|experts\.\d+|shared_experts?)\.(gate_proj|up_proj|gate_up_proj|w1|w3)"
    r"|shared_mlp\.input_linear)$"
]
# MoE routers and shared-expert gates stay dense by default where they are Linears
# (Qwen2-MoE's shared_expert_gate; mlp.gate and router.layer in earlier transformers)
DEFAULT_IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*router(\.layer)?$", r"re:.*_expert_gate$"]


def pruned_modules(
    target_layers: dict[str, torch.nn.Module], sparsity, ignore: list[str], mask_structure: str
) -> list[tuple]:
    """``(name, module, sparsity)`` of every module pruned inside ``target_layers``
    (llmcompressor's selection, names without its trailing dot, so that ``ignore:
    ["lm_head"]`` and ``$``-anchored regexes match what users expect)."""
    modules = []
    for index, (layer_name, layer) in enumerate(target_layers.items()):
        layer_sparsity = sparsity[index] if isinstance(sparsity, list) else sparsity
        for name, module in match_named_modules(layer, PRUNABLE_LAYER_TYPES):
            name = f"{layer_name}.{name}" if name else layer_name
            if isinstance(module, torch.nn.Embedding) or match_targets(name, module, ignore):
                continue
            modules.append((name, module, layer_sparsity))
    n, m = parse_mask_structure(mask_structure)
    check_structure_divides([(name, module) for name, module, _ in modules], n, m)
    return modules


def select_difference_modules(modules: list[tuple], patterns: list[str]) -> set[torch.nn.Module]:
    """The modules of ``modules`` (``pruned_modules``) that ``patterns`` (the
    ``difference_targets``) match; each pattern must match a Linear."""
    selected = set()
    for pattern in patterns:
        matched = [(n, m) for n, m, _ in modules if match_targets(n, m, [pattern])]
        if not matched:
            examples = ", ".join(n for n, _, _ in modules[:8]) or "(none)"
            raise ValueError(
                f"difference_targets pattern {pattern!r} matches none of the "
                f"{len(modules)} modules this modifier prunes; some of them: "
                f"{examples}. Use 're:' for a regex; the default, "
                f"{DEFAULT_DIFFERENCE_TARGETS[0]!r}, reaches the gate and up "
                "projections of the gated MLPs (MoE experts included) of transformers' "
                "families"
            )
        for name, module in matched:
            if not isinstance(module, torch.nn.Linear):
                raise ValueError(
                    f"difference_targets pattern {pattern!r} matches {name}, a "
                    f"{type(module).__name__}; the difference statistics are defined "
                    "for torch.nn.Linear only"
                )
            selected.add(module)
    return selected
