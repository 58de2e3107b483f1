"""Saving a pruned model: one code path for whisper-prune and for llmcompressor's own
``oneshot(..., output_dir=D)`` and ``model.save_pretrained(D, save_compressed=True)``.

* ``write_checkpoint``: into a new directory, after checking in memory that every layer a
  2:4 modifier pruned is exactly 2:4 (nothing is written otherwise): llmcompressor's save
  (compressed-tensors; a quantized chain's scales and packed values), then, for the
  ``compressed`` layout, each 2:4 Linear rewritten as values plus bitmask and every other
  Linear a pruning modifier pruned (unstructured, or N:M other than 2:4) as each row's
  values, a bitmask and row offsets where that is smaller than dense, with the load-time
  guard for stock transformers (``whisper_sparse.format.layout.write_compressed``), and
  ``sparsity_record.json``. MoE experts (``MOE_EXPERT``) are packed back into the
  family's fused experts for the save (``packed_experts``) and stay dense there.
  whisper-prune calls it inside its partial directory.
* ``install_compressed_save``: installed when one of our pruning modifiers finalizes
  (llmcompressor's ``Modifier.on_finalize``, through ``modifiers.finalize_hook``, where
  ``save_compressed_after``, which the package's entry calls, registers it). It wraps
  the model's ``save_pretrained`` (llmcompressor's own wrapper, which ``oneshot`` installs
  first) so that saving with ``save_compressed=True`` (llmcompressor's default) writes
  ``write_checkpoint``'s checkpoint into a locked partial directory renamed into place
  (``output_dir.partial_output``): an interrupted save never leaves a directory that
  looks complete. ``save_compressed=False`` writes llmcompressor's dense layout (zeros
  stored) and the record. A recipe made only of llmcompressor's stock modifiers installs
  nothing: importing this package does not change what a stock recipe saves.

``storage_layout`` says which layout a recipe's checkpoint gets: ``compressed`` for a
pruning recipe, unquantized or quantized to one 8-bit value per weight (W8A8, FP8);
``dense`` otherwise (W4A16 keeps compressed-tensors' packed format).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from pathlib import Path

import torch
from loguru import logger

from whisper_modifiers import checkpoint
from whisper_modifiers.modifiers.finalize_hook import after_pruning_finalize
from whisper_modifiers.modifiers.moe_routing import MOE_EXPERT
from whisper_modifiers.output_dir import check_output_dir, partial_output
from whisper_sparse.format.checkpoint import RECORD_FILE
from whisper_sparse.format.layout import write_compressed
from whisper_sparse.format.two_four import check_two_four

__all__ = [
    "gamma_selection",
    "install_compressed_save",
    "save_compressed_after",
    "llmcompressor_save",
    "packs_weights",
    "prunes",
    "storage_layout",
    "two_four_layers",
    "unstructured_layers",
    "write_checkpoint",
]

_INSTALLED = "_whisper_modifiers_save"  # the attribute our wrapper carries


def _pruned_linears(model, modifier) -> list[str]:
    """Names of the Linear modules that a pruning ``modifier`` prunes."""
    from compressed_tensors.utils import match_named_modules, match_targets

    ignore = list(modifier.ignore or [])
    names = []
    for name, module in match_named_modules(model, modifier.targets, ignore):
        inner = (
            [(name, module)]
            if isinstance(module, torch.nn.Linear)
            else [
                (f"{name}.{n}", m)
                for n, m in module.named_modules()
                if isinstance(m, torch.nn.Linear)
            ]
        )
        names += [n for n, m in inner if not match_targets(n, m, ignore)]
    return names


def _structure(modifier) -> str | None:
    """A pruning modifier's ``mask_structure`` (ours and llmcompressor's); None for others."""
    return getattr(modifier, "mask_structure", None)


def two_four_layers(model, modifiers: list) -> list[str]:
    """Names of the Linear modules that the recipe's 2:4 modifiers prune."""
    return sorted(
        {
            name
            for modifier in modifiers
            if _structure(modifier) == "2:4"
            for name in _pruned_linears(model, modifier)
        }
    )


def unstructured_layers(model, modifiers: list) -> list[str]:
    """Names of the Linear modules that the recipe's other pruning modifiers prune
    (unstructured, or N:M other than 2:4), less those a 2:4 modifier prunes."""
    names = {
        name
        for modifier in modifiers
        if _structure(modifier) not in (None, "2:4")
        for name in _pruned_linears(model, modifier)
    }
    return sorted(names - set(two_four_layers(model, modifiers)))


def packs_weights(modifiers: list) -> bool:
    """Whether a quantization modifier of the recipe packs weights below 8 bits (W4A16)."""
    from llmcompressor.modifiers.quantization.quantization.mixin import QuantizationMixin

    return any(
        group.weights is not None and group.weights.num_bits != 8
        for m in modifiers
        if isinstance(m, QuantizationMixin)
        for group in m.resolved_config.config_groups.values()
    )


def prunes(modifiers: list) -> bool:
    """Whether a modifier of the recipe prunes (any ``mask_structure``)."""
    return any(_structure(m) is not None for m in modifiers)


def storage_layout(modifiers: list) -> str:
    """``compressed`` for a pruning recipe stored unquantized or as 8-bit values, else
    ``dense``."""
    return "compressed" if prunes(modifiers) and not packs_weights(modifiers) else "dense"


def gamma_selection(modifiers) -> dict[str, dict]:
    """``gamma: auto``'s choice per module (``DifferencePruningBase.gamma_selection``) over
    a finished run's modifiers; empty when none chose."""
    return {
        name: choice
        for modifier in modifiers
        if hasattr(modifier, "gamma_selection")
        for name, choice in modifier.gamma_selection().items()
    }


def write_checkpoint(
    model, directory: str | Path, modifiers: list, save, layout: str, **details
) -> dict:
    """Write ``model`` pruned by ``modifiers`` into the new ``directory`` with ``save``
    (llmcompressor's ``save_pretrained``) in ``layout``: ``compressed`` (llmcompressor's
    compressed save, then the pruned layers rewritten: ``write_compressed``), ``dense``
    (its compressed save: a quantized chain's format, pruned zeros stored) or
    ``uncompressed`` (its ``save_compressed=False``), and ``sparsity_record.json`` holding
    ``details`` (recipe, source model, ...). Every layer a 2:4 modifier pruned is checked
    to be exactly 2:4 first (``NotTwoFourError`` naming it; nothing written). Returns
    ``{"record": ..., "compressed": write_compressed's sizes and layers, or None}``."""
    directory = Path(directory)
    two_four = two_four_layers(model, modifiers)
    modules = dict(model.named_modules())
    for name in two_four:
        check_two_four(modules[name].weight.detach(), name)
    names = [type(modifier).__name__ for modifier in modifiers]
    choices = gamma_selection(modifiers)
    details |= {"gamma_selection": choices} if choices else {}
    record = checkpoint.sparsity_record(model, modifiers=names, layout=layout, **details)
    with packed_experts(model):
        save(directory, save_compressed=layout != "uncompressed")
    unstructured = unstructured_layers(model, modifiers)
    experts = [name for name in two_four + unstructured if MOE_EXPERT.match(name)]
    if experts and layout == "compressed":
        logger.warning(
            f"{len(experts)} MoE expert layers ({experts[0]}, ...) are stored dense, in "
            "the model's own fused experts format"
        )
    two_four, unstructured = (
        [n for n in layers if n not in experts] for layers in (two_four, unstructured)
    )
    written = None
    if layout == "compressed" and (two_four or unstructured):
        written = write_compressed(directory, two_four, unstructured)
    checkpoint.write_record(directory, record)
    return {"record": record, "compressed": written}


@contextlib.contextmanager
def packed_experts(model):
    """While saving, llmcompressor's per-expert Linears (``LinearExperts2D``) packed back
    into the model's own fused experts (llmcompressor's ``to_experts_module``), so that
    transformers writes the family's native checkpoint keys (Mixtral's ``w1``/``w3``,
    GPT-OSS' interleaved ``gate_up_proj``) and reloads them; restored afterwards."""
    from llmcompressor.modeling.moe.linearize import get_linearized_moes

    linearized = get_linearized_moes(model)
    try:
        for name, experts in linearized:
            model.set_submodule(name, _packed(name, experts))
        yield
    finally:
        for name, experts in linearized:
            model.set_submodule(name, experts)


@torch.no_grad()
def _packed(name: str, experts):
    """``experts.to_experts_module()``, checked to unpack to the same weights (GPT-OSS'
    gate and up interleaved, which llmcompressor 0.14 packs as halves, are written
    again)."""
    from llmcompressor.modeling.moe.gpt_oss import GptOssLinearExperts

    fused = experts.to_experts_module()
    if isinstance(experts, GptOssLinearExperts):  # columns 0::2 gate, 1::2 up
        for index in range(experts.num_experts):
            expert = experts[index]
            for offset, linear in enumerate((expert.gate_proj, expert.up_proj)):
                fused.gate_up_proj[index, :, offset::2].copy_(linear.weight.t())
                fused.gate_up_proj_bias[index, offset::2].copy_(linear.bias)
    unpacked = type(experts).from_experts_module(fused, experts._source_config)
    for index in range(experts.num_experts):
        for (part, weight), again in zip(
            experts[index].named_parameters(), unpacked[index].parameters(), strict=True
        ):
            if not torch.equal(weight, again):
                raise RuntimeError(
                    f"{name}: packing expert {index}'s {part} into "
                    f"{type(fused).__name__} does not give it back; not saved"
                )
    return fused


def install_compressed_save(model, modifiers: list) -> None:
    """Wrap ``model.save_pretrained`` (see the module docstring) for a model ``modifiers``
    pruned; installing again updates the modifiers."""
    current = model.save_pretrained
    if getattr(current, _INSTALLED, None) is not None:
        getattr(current, _INSTALLED).update(modifiers=list(modifiers), recipe=_recipe_text())
        return
    state = {"modifiers": list(modifiers), "recipe": _recipe_text()}  # while the session lasts
    model_ref = weakref.ref(model)
    takes_compressed = getattr(current, "_overridden", False)  # llmcompressor's wrapper

    def inner(directory, save_compressed=True, **kwargs):
        if takes_compressed:
            return current(directory, save_compressed=save_compressed, **kwargs)
        return current(directory, **kwargs)

    @functools.wraps(current)
    def save_pretrained(save_directory, *args, save_compressed: bool = True, **kwargs):
        if args or not _is_source_process():  # HF's positional options; the other ranks
            return inner(save_directory, *args, save_compressed=save_compressed, **kwargs)
        model = model_ref()
        modifiers = state["modifiers"]
        layout = storage_layout(modifiers) if save_compressed else "uncompressed"
        target = check_output_dir(
            save_directory,
            protected=_protected(model),
            overwrite=True,
            flag="save_pretrained's save_directory",
            marker=RECORD_FILE,
            program="whisper-modifiers",
            output="a whisper-modifiers checkpoint",
        )
        save = functools.partial(inner, **kwargs)
        with partial_output(target) as partial:  # never a half-written checkpoint
            write_checkpoint(
                model,
                partial,
                modifiers,
                save,
                layout,
                recipe=state["recipe"],
                source_model=_source(model),
            )
        return None

    state["inner"] = inner
    setattr(save_pretrained, _INSTALLED, state)
    model.save_pretrained = save_pretrained


def save_compressed_after() -> None:
    """From now on, when one of this package's pruning modifiers finalizes (its
    ``on_finalize``, through ``modifiers.finalize_hook``), ``install_compressed_save`` on its
    model with the active recipe's modifiers; a recipe of stock modifiers alone is left as it
    is. Registering again does nothing."""
    after_pruning_finalize(_install_after_pruning)


def _install_after_pruning(state, modifier) -> None:
    """``finalize_hook``'s callback: the recipe being finalized is the active session's
    (``modifier`` alone where it runs outside one)."""
    model = getattr(state, "model", None)
    if model is None:
        return
    try:
        from llmcompressor.core import active_session

        modifiers = list(active_session().lifecycle.recipe.modifiers)
    except Exception:  # no session, or one without a recipe
        modifiers = []
    install_compressed_save(model, modifiers if modifier in modifiers else [modifier])


def llmcompressor_save(model):
    """llmcompressor's ``save_pretrained`` of ``model``, under ours if ours is installed."""
    ours = getattr(model.save_pretrained, _INSTALLED, None)
    return model.save_pretrained if ours is None else ours["inner"]


def _is_source_process() -> bool:
    from compressed_tensors.distributed import is_source_process

    return is_source_process()


def _recipe_text() -> str | None:
    """The active llmcompressor session's recipe, as YAML."""
    try:
        from llmcompressor.core import active_session

        return active_session().lifecycle.recipe.yaml()
    except Exception:  # no session, or a recipe that cannot be written back
        return None


def _source(model) -> str | None:
    return getattr(getattr(model, "config", None), "_name_or_path", None) or None


def _protected(model) -> list[Path]:
    """The source model's directory, when it is one: saving over it is refused."""
    source = _source(model)
    return [Path(source)] if source and Path(source).is_dir() else []
