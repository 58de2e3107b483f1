"""transformers support for compressed sparse checkpoints: after ``import
whisper_modifiers``, ``AutoModelForCausalLM.from_pretrained`` loads them.

``register`` adds a quantization config and an ``HfQuantizer`` under ``QUANT_METHODS``
(the method's name, and its name before unstructured layers) through transformers' own
registry (``register_quantization_config``, ``register_quantizer``). On a CPU where the CPU
op runs, an unquantized checkpoint's compressed Linears become ``cpu.linear`` modules
(``CpuSparse24Linear`` for 2:4 layers, ``CpuBitmaskLinear`` for unstructured ones), which
load the stored tensors as their parameters and run the op: generation reads the
compressed bytes, and ``save_pretrained`` writes the compressed layout again. Everywhere
else the quantizer changes no module: its weight conversion turns the stored tensors into
the dense ``weight`` while transformers loads them (``format.layout.decompress_stored``),
multiplied by its ``weight_scale`` in a W8A8 / FP8 chain, and the
loaded model is an ordinary dense model (a quantized chain's activations are not
fake-quantized: ``checkpoint.load_checkpoint`` gives compressed-tensors' quantized
forward), which ``save_pretrained`` writes in the dense layout.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name
from transformers.utils.quantization_config import QuantizationConfigMixin

from whisper_sparse.cpu.linear import (
    CpuBitmaskLinear,
    CpuSparse24Linear,
    cpu_serving_refusal,
)
from whisper_sparse.format.declaration import (
    BITMASK_FORMAT,
    QUANT_METHOD,
    QUANT_METHODS,
    STOCK_LOADER_GUARDS,
    TWO_FOUR_FORMAT,
)
from whisper_sparse.format.layout import (
    add_loader_guard,
    decompress_stored,
    dequantize,
    verify_compressed_layers,
)
from whisper_sparse.mode import kernel_mode

__all__ = [
    "SparseDecompress",
    "SparseHfQuantizer",
    "SparseTransformersConfig",
    "loading_dense",
    "register",
]

logger = logging.getLogger(__name__)
# the checkpoint tensors of a compressed layer that its dense ``weight`` is made of
STORED_PARTS = ("compressed", "bitmask", "row_offsets", "shape", "weight_scale")


class SparseTransformersConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` of a compressed sparse checkpoint
    (``format.declaration``)."""

    def __init__(
        self,
        targets=None,
        format="sparse-24-bitmask",
        sparsity_structure="2:4",
        quantization_config=None,
        bitmask_targets=None,
        **kwargs,
    ):
        self.quant_method = QUANT_METHOD
        self.quantization_config = quantization_config  # of a W8A8 / FP8 chain
        self.targets = list(targets or [])
        self.bitmask_targets = list(bitmask_targets or [])
        self.format = format
        self.sparsity_structure = sparsity_structure
        # the weights load dense: transformers then drops the quantization config, and
        # the model is an ordinary dense one (save_pretrained writes the dense layout)
        self.dequantize = True


class SparseDecompress(ConversionOps):
    """``compressed``, ``bitmask``, ``shape`` (``row_offsets`` for an unstructured layer;
    ``weight_scale`` of a quantized chain) -> the dense, dequantized ``weight``."""

    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        def first(key):
            value = input_dict[key]
            return value[0] if isinstance(value, list) else value

        shape = first("shape").reshape(-1).tolist()
        scale = first("weight_scale") if input_dict.get("weight_scale") else None
        layer = (full_layer_name or "weight").removesuffix(".weight")
        row_offsets = first("row_offsets") if input_dict.get("row_offsets") else None
        dense = decompress_stored(first("compressed"), first("bitmask"), row_offsets, shape, layer)
        dense = dequantize(dense, scale)
        if model is not None and full_layer_name is not None:
            module, name = get_module_from_name(model, full_layer_name)
            target = getattr(module, name, None)
            if isinstance(target, torch.Tensor) and target.is_floating_point():
                dense = dense.to(target.dtype)
        return {full_layer_name or "weight": dense}


class SparseHfQuantizer(HfQuantizer):
    """Loads a compressed sparse checkpoint: on a CPU, where the CPU op runs
    (``cpu.linear``), each compressed Linear of an unquantized checkpoint becomes a
    ``CpuSparse24Linear`` or ``CpuBitmaskLinear`` that loads the stored tensors as they
    are; otherwise (a GPU, a W8A8 / FP8 chain, float16, the ``dense`` kernel mode,
    ``loading_dense()``) the weights load dense (``SparseDecompress``) into an ordinary
    model."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.compressed_layers: list[str] = []  # those kept compressed in this load

    def update_tp_plan(self, config):
        # the one hook that sees the model config before transformers resolves the
        # weight files: the guard against stock loaders is not a file name
        if getattr(config, "transformers_weights", None) in STOCK_LOADER_GUARDS:
            delattr(config, "transformers_weights")
        return super().update_tp_plan(config)

    def _process_model_before_weight_loading(
        self, model, checkpoint_files=None, device_map=None, dtype=None, **kwargs
    ):
        # every stored layer is checked here, before loading: an error raised during
        # transformers' weight conversion is only logged in its report
        linears = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
        expected = {name: tuple(module.weight.shape) for name, module in linears.items()}
        declared = self.quantization_config
        layers = verify_compressed_layers(
            checkpoint_files or [],
            expected,
            {
                **dict.fromkeys(declared.targets, TWO_FOUR_FORMAT),
                **dict.fromkeys(declared.bitmask_targets, BITMASK_FORMAT),
            },
        )
        if self._keeps_compressed(device_map, dtype or torch.get_default_dtype()):
            for name, stored in layers.items():
                linear = linears[name]
                parent, _, child = name.rpartition(".")
                sizes = (linear.out_features, linear.in_features)
                if stored.format == BITMASK_FORMAT:
                    sizes += (stored.values,)
                module = CpuBitmaskLinear if stored.format == BITMASK_FORMAT else CpuSparse24Linear
                setattr(
                    model.get_submodule(parent),
                    child,
                    module(
                        *sizes, linear.bias is not None, linear.weight.dtype, linear.weight.device
                    ),
                )
            self.compressed_layers = list(layers)
        return model

    def _keeps_compressed(self, device_map, dtype: torch.dtype) -> bool:
        if _dense_loading or self.quantization_config.quantization_config:
            return False  # a quantized chain's weights load dequantized
        devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
        if not devices <= {None, "cpu", torch.device("cpu")}:
            return False
        refusal = cpu_serving_refusal("cpu", dtype)
        if refusal is not None and kernel_mode() != "dense":
            logger.info("whisper-modifiers: compressed layers load dense: %s", refusal)
        return refusal is None

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.compressed_layers:
            for name in self.compressed_layers:  # checked: the op reads values by position
                model.get_submodule(name).serve(name)
            _guard_saves(model)
            return model
        # the weights are dense now: nothing to redo when saving (save_pretrained would
        # otherwise try to reverse the decompression)
        model._weight_conversions = [
            conversion
            for conversion in getattr(model, "_weight_conversions", None) or []
            if not any(
                isinstance(op, SparseDecompress) for op in getattr(conversion, "operations", [])
            )
        ]
        return model

    def postprocess_model(self, model, **kwargs):
        # kept compressed, the model saves the compressed layout and its config
        self.quantization_config.dequantize = not self.compressed_layers
        return super().postprocess_model(model, **kwargs)

    def is_serializable(self):
        return True  # dense after loading, or the checkpoint's own compressed layout

    @property
    def is_trainable(self):
        return not self.compressed_layers  # the op has no backward

    def get_weight_conversions(self):
        if self.compressed_layers:
            return []  # the stored tensors are the modules' parameters
        return [
            WeightConverter(
                source_patterns=list(STORED_PARTS),
                target_patterns="weight",
                operations=[SparseDecompress()],
            )
        ]


def _guard_saves(model) -> None:
    """``model.save_pretrained`` of a model kept compressed writes the stock-loader guard
    into the saved ``config.json`` as whisper-prune does (``format.layout.add_loader_guard``):
    transformers drops ``transformers_weights`` from every config it saves."""
    save = model.save_pretrained

    @functools.wraps(save)
    def save_pretrained(save_directory, *args, **kwargs):
        result = save(save_directory, *args, **kwargs)
        add_loader_guard(save_directory)
        return result

    model.save_pretrained = save_pretrained


_dense_loading = False


@contextlib.contextmanager
def loading_dense():
    """Within it, compressed checkpoints load with dense weights wherever they load
    (``checkpoint.load_checkpoint``: the weights as numbers, for comparisons)."""
    global _dense_loading
    previous, _dense_loading = _dense_loading, True
    try:
        yield
    finally:
        _dense_loading = previous


_registered = False


def register() -> None:
    """Register the config and quantizer with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    for name in QUANT_METHODS:
        register_quantization_config(name)(SparseTransformersConfig)
        register_quantizer(name)(SparseHfQuantizer)
    _registered = True
