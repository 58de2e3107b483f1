"""transformers support for compressed 2:4 checkpoints: after ``import whisper_modifiers``,
``AutoModelForCausalLM.from_pretrained`` loads them with dense weights.

``register`` adds a quantization config and an ``HfQuantizer`` under ``QUANT_METHOD``
through transformers' own registry (``register_quantization_config``,
``register_quantizer``). The quantizer changes no module: its weight conversion turns the
three checkpoint tensors of a 2:4 Linear (``compressed``, ``bitmask``, ``shape``) into the
dense ``weight`` while transformers loads them (``format.decompress_24``), multiplied by
its ``weight_scale`` in a W8A8 / FP8 chain. The loaded model is an ordinary dense model
(a quantized chain's activations are not fake-quantized: ``checkpoint.load_checkpoint``
gives compressed-tensors' quantized forward); ``save_pretrained`` writes the dense layout.
"""

from __future__ import annotations

import torch
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name
from transformers.utils.quantization_config import QuantizationConfigMixin

from whisper_modifiers.sparse_serving.format import (
    QUANT_METHOD,
    STOCK_LOADER_GUARD,
    decompress_24,
)
from whisper_modifiers.sparse_serving.layout import dequantize, verify_compressed_layers

__all__ = ["Sparse24Decompress", "Sparse24HfQuantizer", "Sparse24TransformersConfig", "register"]


class Sparse24TransformersConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` of a compressed 2:4 checkpoint."""

    def __init__(self, targets=None, format="sparse-24-bitmask", sparsity_structure="2:4",
                 quantization_config=None, **kwargs):  # fmt: skip
        self.quant_method = QUANT_METHOD
        self.quantization_config = quantization_config  # of a W8A8 / FP8 chain
        self.targets = list(targets or [])
        self.format = format
        self.sparsity_structure = sparsity_structure
        # the weights load dense: transformers then drops the quantization config, and
        # the model is an ordinary dense one (save_pretrained writes the dense layout)
        self.dequantize = True


class Sparse24Decompress(ConversionOps):
    """``compressed``, ``bitmask``, ``shape`` (and ``weight_scale`` of a quantized
    chain) -> the dense, dequantized ``weight``."""

    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        def first(key):
            value = input_dict[key]
            return value[0] if isinstance(value, list) else value

        shape = first("shape").reshape(-1).tolist()
        scale = first("weight_scale") if input_dict.get("weight_scale") else None
        layer = (full_layer_name or "weight").removesuffix(".weight")
        dense = decompress_24(first("compressed"), first("bitmask"), shape, layer)
        dense = dequantize(dense, scale)
        if model is not None and full_layer_name is not None:
            module, name = get_module_from_name(model, full_layer_name)
            target = getattr(module, name, None)
            if isinstance(target, torch.Tensor) and target.is_floating_point():
                dense = dense.to(target.dtype)
        return {full_layer_name or "weight": dense}


class Sparse24HfQuantizer(HfQuantizer):
    """Loads compressed 2:4 weights dense; the model itself is not changed."""

    requires_calibration = False

    def update_tp_plan(self, config):
        # the one hook that sees the model config before transformers resolves the
        # weight files: the guard against stock loaders is not a file name
        if getattr(config, "transformers_weights", None) == STOCK_LOADER_GUARD:
            delattr(config, "transformers_weights")
        return super().update_tp_plan(config)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None,
                                             **kwargs):  # fmt: skip
        # every stored 2:4 layer is checked here, before loading: an error raised
        # during transformers' weight conversion is only logged in its report
        expected = {
            name: tuple(module.weight.shape)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
        verify_compressed_layers(checkpoint_files or [], expected)  # fmt: skip
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        # the weights are dense now: nothing to redo when saving (save_pretrained would
        # otherwise try to reverse the decompression)
        model._weight_conversions = [
            conversion
            for conversion in getattr(model, "_weight_conversions", None) or []
            if not any(
                isinstance(op, Sparse24Decompress) for op in getattr(conversion, "operations", [])
            )  # fmt: skip
        ]
        return model

    def is_serializable(self):
        return True  # the model is dense after loading

    @property
    def is_trainable(self):
        return True  # the loaded weights are ordinary dense tensors

    def get_weight_conversions(self):
        return [
            WeightConverter(
                source_patterns=["compressed", "bitmask", "shape", "weight_scale"],
                target_patterns="weight",
                operations=[Sparse24Decompress()],
            )
        ]


_registered = False


def register() -> None:
    """Register the config and quantizer with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    register_quantization_config(QUANT_METHOD)(Sparse24TransformersConfig)
    register_quantizer(QUANT_METHOD)(Sparse24HfQuantizer)
    _registered = True
