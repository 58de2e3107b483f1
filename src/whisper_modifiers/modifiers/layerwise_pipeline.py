"""``whisper_layerwise``: a calibration pipeline registered with llmcompressor that runs a
model decoder layer by decoder layer, as the paper's reference code does.

    oneshot(model=model, dataset=..., recipe=recipe, pipeline="whisper_layerwise")

It has the lifecycle of llmcompressor's sequential pipeline, so every modifier works
unchanged (ours, llmcompressor's Wanda, SparseGPT and GPTQ, masked GPTQ):
``calibration_start``; per decoder layer a pass with the modifiers' hooks,
``sequential_epoch_end`` over the layer's modules, and a pass without hooks whose outputs
feed the next layer (``propagate_error``); ``calibration_end``. What differs is how a
layer runs:

* the decoder layers themselves are called, with the keyword arguments (rotary
  embeddings, masks) the model gave each of them, recorded once per batch by a pass of
  the model in which every layer is replaced by a recorder (``recording_layers``); no
  traced subgraphs;
* on a GPU, attention is the model's own (SDPA unless it was loaded with another), where
  llmcompressor's pipeline forces eager attention for its traced graphs; on a CPU it stays
  eager, and the two pipelines give the same bits (``attention_implementation``);
* the activation cache stays on ``sequential_offload_device`` (``methods.calibration_settings``
  keeps it on the GPU when it fits).

Modules with hooks outside the decoder layers are calibrated where the sequential
pipeline calibrates them: those before the first layer in the recording pass, those
after the last layer (an unignored ``lm_head``) in a pass that feeds them the last layer's
outputs (``tail_pass``). A model whose layers are not one chain of calls (``chain_fault``)
is handed to llmcompressor's sequential pipeline, with one line saying why.
"""

from __future__ import annotations

import contextlib
import os

import torch
from compressed_tensors.offload import disable_offloading, set_onload_device
from compressed_tensors.utils import match_named_modules, patch_attr
from llmcompressor.core import LifecycleCallbacks, active_session
from llmcompressor.modifiers.utils.hooks import HooksMixin
from llmcompressor.pipelines.cache import IntermediatesCache
from llmcompressor.pipelines.registry import CalibrationPipeline
from llmcompressor.pipelines.sequential.helpers import handle_sequential_oom
from llmcompressor.pipelines.sequential.pipeline import SequentialPipeline
from llmcompressor.utils.dev import get_main_device
from llmcompressor.utils.helpers import DisableQuantization, calibration_forward_context
from llmcompressor.utils.pytorch.module import infer_sequential_targets
from loguru import logger
from tqdm import tqdm

__all__ = [
    "ATTENTION_CHOICES",
    "ATTENTION_VARIABLE",
    "PIPELINE_NAME",
    "LayerwisePipeline",
    "attention_implementation",
    "calibrate",
    "check_attention_variable",
    "chain_fault",
    "decoder_layers",
]

PIPELINE_NAME = "whisper_layerwise"
ATTENTION_VARIABLE = "WHISPER_LAYERWISE_ATTENTION"
ATTENTION_CHOICES = ("auto", "eager", "model")


class _StopForward(Exception):
    """Raised by the last layer's recorder: nothing after the decoder layers runs."""


@CalibrationPipeline.register(PIPELINE_NAME)
class LayerwisePipeline(CalibrationPipeline):
    @staticmethod
    @handle_sequential_oom
    def __call__(model: torch.nn.Module, dataloader, dataset_args):
        """Calibrate ``model`` decoder layer by decoder layer (module docstring). As in
        ``oneshot``'s default ``independent`` pipeline, each modifier of a recipe gets its
        own calibration, in recipe order (a chained recipe quantizes the pruned model);
        modifiers that need no data run llmcompressor's ``datafree`` pipeline."""
        device = get_main_device()
        attention = attention_implementation(model, device)  # a bad setting fails first
        recipe = active_session().lifecycle.recipe
        modifiers = recipe.modifiers
        with patch_attr(recipe, "modifiers", None):
            for modifier in modifiers:
                recipe.modifiers = [modifier]
                if modifier.requires_calibration_data:
                    calibrate(model, dataloader, dataset_args, device, attention)
                else:
                    CalibrationPipeline.from_modifiers([modifier])(model, dataloader, dataset_args)


def calibrate(model, dataloader, dataset_args, device: torch.device, attention: str | None):
    """One calibration of the session's modifiers, layer by layer on ``device`` with
    ``attention``; llmcompressor's sequential pipeline where ``chain_fault`` finds the
    model cannot be run so."""
    layers = decoder_layers(model, dataset_args.sequential_targets)
    set_onload_device(model, device)
    fault = chain_fault(model, layers, _to_device(next(iter(dataloader)), device))
    if fault:
        logger.warning(f"{PIPELINE_NAME}: {fault}; using llmcompressor's sequential pipeline")
        return SequentialPipeline()(model, dataloader, dataset_args)
    session = active_session()
    modifiers = session.lifecycle.recipe.modifiers
    if any(type(m).__name__ == "AutoRoundModifier" for m in modifiers):
        dataset_args.propagate_error = False  # as llmcompressor's sequential pipeline
    session.state.loss_masks = (
        [batch.get("loss_mask") for batch in dataloader]
        if getattr(dataset_args, "use_loss_mask", False)
        else None
    )
    LifecycleCallbacks.calibration_start()
    with _calibration_context(model, attention):
        owners = _hook_owners(model, modifiers)
        inside = {m for layer in layers for m in layer.modules()}
        outside = {handle for handle, module in owners.items() if module not in inside}
        cache, called = _record_inputs(model, layers, dataloader, device, dataset_args, outside)
        tail = {handle for handle in outside if owners[handle] not in called}
        _calibrate_layers(model, layers, cache, dataset_args, tail, owners)
    LifecycleCallbacks.calibration_end()


def decoder_layers(model: torch.nn.Module, sequential_targets=None) -> list[torch.nn.Module]:
    """The modules the sequential pipeline would split at (``sequential_targets``, by
    default the model's ``_no_split_modules``: its decoder layers), outermost only."""
    targets = infer_sequential_targets(model, sequential_targets)
    found = [module for _, module in match_named_modules(model, targets)]
    nested = {inner for module in found for inner in module.modules() if inner is not module}
    return [module for module in found if module not in nested]


def chain_fault(model: torch.nn.Module, layers: list, batch: dict) -> str | None:
    """Why ``model`` cannot be run layer by layer, or ``None``: its forward must call each
    layer once, in order, each on the previous one's output, the first positional argument
    (or ``hidden_states``). Checked on one batch, before any modifier hook exists."""
    if not layers:
        return "no decoder layers found (set sequential_targets)"
    with _calibration_context(model), HooksMixin.disable_hooks():
        calls = _recorded_calls(model, layers, batch)
    order = [index for index, _, _ in calls]
    if order != list(range(len(layers))):
        return f"the forward called its {len(layers)} layers in the order {order[:8]}"
    if any(hidden is None or hidden is not calls[0][1] for _, hidden, _ in calls):
        return "a layer's input is not the previous layer's output"
    return None


@contextlib.contextmanager
def recording_layers(layers: list, calls: list, replay=None):
    """Replace each layer's forward: it appends ``(index, hidden input, (args, kwargs))``
    to ``calls`` and returns its input (the last raises ``_StopForward``), or, with
    ``replay(index, hidden)``, returns what that gives."""

    def recorder(index):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs.pop("hidden_states", None)
            calls.append((index, hidden, (args[1:], kwargs)))
            if replay is not None:
                return replay(index, hidden)
            if index == len(layers) - 1:
                raise _StopForward
            return hidden

        return forward

    with contextlib.ExitStack() as stack:
        for index, layer in enumerate(layers):
            stack.enter_context(patch_attr(layer, "forward", recorder(index)))
        yield


def _recorded_calls(model, layers: list, batch: dict) -> list:
    """``recording_layers``' calls of one forward of ``model`` on ``batch``, which stops
    at the last layer."""
    calls = []
    try:
        with recording_layers(layers, calls):
            model(**batch)
    except _StopForward:
        pass
    return calls


def _record_inputs(model, layers, dataloader, device, dataset_args, keep):
    """The recording pass over every batch: the first layer's input and each layer's
    other arguments, cached per batch; hooks outside the layers (``keep``) fire. Returns
    the cache and the modules that ran."""
    cache = IntermediatesCache(offload_device=torch.device(dataset_args.sequential_offload_device))
    called = set()
    track = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, _: called.add(m))
    try:
        for batch in tqdm(dataloader, desc=f"{PIPELINE_NAME}: recording layer inputs"):
            batch = _to_device(batch, device)
            with HooksMixin.disable_hooks(keep=keep):
                calls = _recorded_calls(model, layers, batch)
            if len(calls) != len(layers):
                raise RuntimeError(
                    f"{PIPELINE_NAME}: a batch reached {len(calls)} of the "
                    f"{len(layers)} decoder layers"
                )
            values = {f"layer.{index}": arguments for index, _, arguments in calls}
            cache.append({"hidden": calls[0][1], "batch": batch, **values})
    finally:
        track.remove()
    return cache, called


def _calibrate_layers(model, layers, cache, dataset_args, tail, owners):
    """Per layer: the pass with hooks, ``sequential_epoch_end``, the pass without hooks
    that feeds the next layer. The modules after the last layer (``tail``) are calibrated
    on its outputs before its ``sequential_epoch_end``, as they share its subgraph in the
    sequential pipeline."""
    session = active_session()
    for index, layer in enumerate(layers):
        last = index == len(layers) - 1
        step = f"({index + 1}/{len(layers)}):"
        with disable_offloading():
            keep_outputs = (not dataset_args.propagate_error and not last) or (last and tail)
            for batch_index in tqdm(range(len(cache)), desc=f"{step} Calibrating"):
                session.state.current_batch_idx = batch_index
                output = _run_layer(layer, index, cache, batch_index)
                if keep_outputs:
                    cache.update(batch_index, {"hidden": output})
            modules = list(layer.modules())
            if last and tail:
                modules += tail_pass(model, layers, cache, tail, owners)
            LifecycleCallbacks.sequential_epoch_end(modules)
            if dataset_args.propagate_error and not last:
                with HooksMixin.disable_hooks():
                    for batch_index in tqdm(range(len(cache)), desc=f"{step} Propagating"):
                        output = _run_layer(layer, index, cache, batch_index)
                        cache.update(batch_index, {"hidden": output})
        for batch_index in range(len(cache)):
            cache.delete(batch_index, [f"layer.{index}"])


def _run_layer(layer, index: int, cache: IntermediatesCache, batch_index: int) -> torch.Tensor:
    inputs = cache.fetch(batch_index, ["hidden", f"layer.{index}"])
    args, kwargs = inputs[f"layer.{index}"]
    output = layer(inputs["hidden"], *args, **kwargs)
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"{PIPELINE_NAME}: decoder layer {index} returned a {type(output).__name__}, not "
            "a tensor; run this model with pipeline='sequential'"
        )
    return output


def tail_pass(model, layers, cache, tail: set, owners: dict) -> list[torch.nn.Module]:
    """Run the model over every batch with the layers replaced by the last layer's cached
    outputs, so that only the hooks after the layers (``tail``) see real inputs; returns
    their modules."""
    current = {}
    calls = []

    def replay(index, hidden):
        return current["hidden"] if index == len(layers) - 1 else hidden

    with recording_layers(layers, calls, replay), HooksMixin.disable_hooks(keep=tail):
        for batch_index in range(len(cache)):
            current.update(cache.fetch(batch_index, ["hidden", "batch"]))
            model(**current["batch"])
    return list(dict.fromkeys(owners[handle] for handle in tail))


def _hook_owners(model: torch.nn.Module, modifiers) -> dict:
    """Each modifier forward (pre-)hook handle -> the module it is registered on."""
    owners = {}
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            owners[id(hooks)] = module
    found = {}
    for modifier in modifiers:
        for handle in getattr(modifier, "_hooks", ()):
            hooks = handle.hooks_dict_ref()
            if hooks is not None and id(hooks) in owners:
                found[handle] = owners[id(hooks)]
    return found


def attention_implementation(model: torch.nn.Module, device: torch.device) -> str | None:
    """The attention the layers run with, from ``$WHISPER_LAYERWISE_ATTENTION``:

    * ``auto`` (default): ``eager`` on a CPU, the model's own on an accelerator;
    * ``eager``: llmcompressor's choice, the same bits as its sequential pipeline;
    * ``model``: the attention the model was loaded with (transformers' default: SDPA).

    SDPA is what makes long sequences fast on a GPU. On a CPU eager keeps the sequential
    pipeline's bits, and the pipeline is still faster (``benchmarks/results/pipeline``);
    SDPA rounds differently: on stories260K it moved 1.1 % of Whisper's 2:4 mask and 3 %
    of ALPS's (``docs/gpu.md``)."""
    choice = check_attention_variable()
    if choice == "eager" or (choice == "auto" and device.type == "cpu"):
        return "eager"
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def check_attention_variable() -> str:
    """``$WHISPER_LAYERWISE_ATTENTION`` (default ``auto``), refused unless one of
    ``ATTENTION_CHOICES``."""
    choice = os.environ.get(ATTENTION_VARIABLE, "auto")
    if choice not in ATTENTION_CHOICES:
        raise ValueError(
            f"{ATTENTION_VARIABLE} must be one of {', '.join(ATTENTION_CHOICES)}; got {choice!r}"
        )
    return choice


@contextlib.contextmanager
def _calibration_context(model: torch.nn.Module, attention: str | None = None):
    """llmcompressor's calibration context (no grad, no KV cache, eval, no LM head output,
    eager attention), quantization disabled, and ``attention`` if given."""
    config = getattr(model, "config", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(calibration_forward_context(model))
        stack.enter_context(DisableQuantization(model))
        if attention is not None:
            stack.enter_context(patch_attr(config, "_attn_implementation", attention))
        yield


def _to_device(batch: dict, device: torch.device) -> dict:
    return {
        key: value.to(device) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
    }
