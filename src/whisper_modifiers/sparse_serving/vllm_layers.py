"""The vLLM side of compressed 2:4 checkpoints: the quantization config that
``vllm_plugin.register`` registers with vLLM and the linear methods it gives each layer
(``Sparse24LinearMethod``, ``QuantizedChainLinearMethod``); the loading of the compressed
tensors with their checks is ``vllm_loading``'s.

Imports vLLM at import time: only ``vllm_plugin.register`` imports it, once vLLM runs.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from whisper_modifiers.sparse_serving.compile_key import note_layer
from whisper_modifiers.sparse_serving.cpu_fp8 import (
    EMULATED_FP8_NOTE,
    dequantized_fp8_weight,
    emulated_fp8,
)
from whisper_modifiers.sparse_serving.cpu_int8 import ExactInt8Linear, wants_exact_int8
from whisper_modifiers.sparse_serving.cpu_linear import cpu_serving_kernel, cpu_serving_refusal
from whisper_modifiers.sparse_serving.format import QUANT_METHOD
from whisper_modifiers.sparse_serving.kernels import kernel_mode, serving_kernel
from whisper_modifiers.sparse_serving.vllm_loading import (
    check_stored_rows,
    register_compressed,
    take_dense_weight,
)
from whisper_modifiers.sparse_serving.weight_bytes import DENSE_BYTES_ATTRIBUTE

__all__ = [
    "QuantizedChainLinearMethod",
    "Sparse24Config",
    "Sparse24LinearMethod",
]

_LEGACY_FORMAT = "sparse-24-bitmask"
# under vLLM's own logger, so that its handler prints these lines with its own (a logger
# outside the "vllm" namespace has no handler in a vLLM process and says nothing)
logger = init_logger(f"vllm.plugins.{__name__}")


class Sparse24LinearMethod(UnquantizedLinearMethod):
    """A 2:4 layer loaded compressed (``vllm_loading``; merged layers and tensor-parallel
    shards load as the dense weight would), then run by, in this order:

    * on a CPU, the 2:4 CPU op on the compressed tensors as loaded (``cpu_linear``), where
      it runs here and, in the ``auto`` kernel mode, its measured plan beats dense at one
      token; the dense weight never exists;
    * on sm80+ GPUs in 16-bit dtypes, cuSPARSELt's 2:4 GEMM with its measured dispatch
      (``kernels.serving_kernel``);
    * elsewhere, or in the ``dense`` mode (``$WHISPER_MODIFIERS_SPARSE24``), vLLM's
      unquantized path on the decompressed weight."""

    def __init__(self, name: str, vllm_config=None):
        super().__init__()
        self.name = name
        self.vllm_config = vllm_config  # whose compile-cache key records the kernel

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype,
                       **extra_weight_attrs):  # fmt: skip
        weight_loader = extra_weight_attrs.pop("weight_loader")
        register_compressed(layer, self.name, input_size_per_partition, input_size,
                            sum(output_partition_sizes), params_dtype, weight_loader,
                            extra_weight_attrs)  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        rows, columns = layer.sparse24_dense_shape
        setattr(layer, DENSE_BYTES_ATTRIBUTE, rows * columns * layer.compressed.element_size())
        kernel = self._cpu_kernel(layer)
        if kernel is not None:
            layer.sparse24_kernel = kernel
            plan = kernel.plan
            self._note(kernel_mode(), {"cpu_gemm_from": plan.gemm_from,
                                       "cpu_tiled_from": plan.tiled_from})  # fmt: skip
            dtype = str(kernel.compressed.dtype).removeprefix("torch.")
            logger.info_once(f"2:4 CPU op, [{rows} x {columns}] {dtype} layers: "
                             f"{plan.describe()}")  # fmt: skip
            return
        weight = take_dense_weight(layer)
        kernel = serving_kernel(weight)
        self._note(kernel_mode(), None if kernel is None else asdict(kernel.plan))
        if kernel is None or kernel.dense is not None:
            layer.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
        if kernel is None:
            super().process_weights_after_loading(layer)
        else:
            layer.sparse24_kernel = kernel

    def _cpu_kernel(self, layer):
        """The CPU op's module over the loaded tensors (which then leave the layer), or None;
        on a CPU where the op cannot run, says why once."""
        compressed = layer.compressed.data
        if compressed.device.type != "cpu":
            return None
        refusal = cpu_serving_refusal(compressed.device, compressed.dtype)
        if refusal is not None:
            logger.info_once(f"2:4 layers run decompressed to dense on this CPU: {refusal}")
            return None
        check_stored_rows(layer)
        kernel = cpu_serving_kernel(compressed, layer.bitmask.data, layer.sparse24_dense_shape[1],
                                    self.name)  # fmt: skip
        if kernel is None:
            logger.info_once("2:4 layers whose measured CPU op was slower than dense at one "
                             "token run dense (set WHISPER_MODIFIERS_SPARSE24=sparse to keep "
                             "them compressed)")  # fmt: skip
            return None
        for part in ("compressed", "bitmask", "shape"):
            delattr(layer, part)
        return kernel

    def _note(self, mode: str, plan: dict | None) -> None:
        if self.vllm_config is not None:
            note_layer(self.vllm_config, self.name, mode, plan)

    def apply(self, layer, x, bias=None):
        kernel = getattr(layer, "sparse24_kernel", None)
        if kernel is None:
            return super().apply(layer, x, bias)
        return kernel.linear(x, bias)


class QuantizedChainLinearMethod(LinearMethodBase):
    """A W8A8 / FP8 chain's quantized layer: compressed-tensors' scheme for this layer
    (``inner``, vLLM's own kernels); if ``compressed``, its quantized weight is loaded
    compressed and decompressed before the scheme processes it. Where vLLM's kernel for the
    layer would not compute well on this CPU, the plugin's replacement runs instead:
    ``cpu_int8.ExactInt8Linear`` where the oneDNN int8 GEMM saturates, and the weight
    dequantized to the model's dtype (``cpu_fp8``) where FP8 has only the emulated path."""

    def __init__(self, name: str, inner, compressed: bool = True):
        self.name = name
        self.inner = inner
        self.compressed = compressed

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype,
                       **extra_weight_attrs):  # fmt: skip
        self.inner.create_weights(layer, input_size_per_partition, output_partition_sizes,
                                  input_size, output_size, params_dtype,
                                  **extra_weight_attrs)  # fmt: skip
        layer.sparse24_params_dtype = params_dtype
        if not self.compressed:
            return
        quantized = layer.weight  # the scheme's [out, in] int8 / float8 parameter
        del layer.weight
        layer.sparse24_weight_class = type(quantized)
        extra = {k: v for k, v in extra_weight_attrs.items() if k != "weight_loader"}
        register_compressed(layer, self.name, input_size_per_partition, input_size,
                            sum(output_partition_sizes), quantized.dtype,
                            extra_weight_attrs["weight_loader"], extra)  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        if self.compressed:
            weight = take_dense_weight(layer)
            try:  # vLLM's parameter class for it, as the scheme created it
                parameter = layer.sparse24_weight_class(
                    data=weight, input_dim=1, output_dim=0, weight_loader=lambda *a: None
                )
            except TypeError:
                parameter = torch.nn.Parameter(weight, requires_grad=False)
            layer.register_parameter("weight", parameter)
        weight = layer.weight.data
        widths = list(getattr(layer, "logical_widths", None) or [weight.shape[0]])
        if wants_exact_int8(layer):  # vLLM's int8 GEMM saturates on this CPU
            layer.exact_int8 = ExactInt8Linear(weight, layer.weight_scale.data, widths)
            del layer.weight
            return
        if emulated_fp8(layer):  # vLLM's FP8 path here is torch._scaled_mm emulation
            dtype = layer.sparse24_params_dtype
            dense = dequantized_fp8_weight(weight, layer.weight_scale.data, widths, dtype)
            logger.warning_once(EMULATED_FP8_NOTE.format(
                kernel=type(layer.scheme.fp8_linear).__name__, dtype=str(dtype).split(".")[-1]
            ))  # fmt: skip
            for name in ("weight", "weight_scale", "input_scale"):
                if hasattr(layer, name):
                    delattr(layer, name)
            layer.register_parameter("weight", torch.nn.Parameter(dense, requires_grad=False))
            layer.dequantized_fp8 = UnquantizedLinearMethod()
            layer.dequantized_fp8.process_weights_after_loading(layer)
            return
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        exact = getattr(layer, "exact_int8", None)
        if exact is not None:
            return exact(x, bias)
        dequantized = getattr(layer, "dequantized_fp8", None)
        if dequantized is not None:
            return dequantized.apply(layer, x, bias)
        return self.inner.apply(layer, x, bias)


class Sparse24Config(QuantizationConfig):
    """Compressed 2:4 Linear weights (``targets``; ``Linear`` for every one but
    ``ignore``), decompressed at load time."""

    linear_method = Sparse24LinearMethod

    def __init__(self, targets: list[str], ignore: list[str], quantization=None):
        super().__init__()
        self.targets = targets
        self.ignore = ignore
        self.quantization = quantization  # compressed-tensors' config of a W8A8 / FP8 chain

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # decompressed to dense: any device

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Sparse24Config:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
            CompressedTensorsConfig,
        )

        sparsity = config.get("sparsity_config") or config
        nested = config.get("quantization_config")
        return cls(
            list(sparsity.get("targets") or []),
            list(sparsity.get("ignore") or []),
            CompressedTensorsConfig.from_config(nested) if nested else None,
        )

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, **kwargs):
        sparsity = (hf_quant_cfg or {}).get("sparsity_config") or {}
        if (
            hf_quant_cfg.get("quant_method") == "compressed-tensors"
            and sparsity.get("format") == _LEGACY_FORMAT
            and not hf_quant_cfg.get("config_groups")
        ):
            return QUANT_METHOD  # the legacy layout is ours; quantized ones are not
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """Rename ``targets`` and ``ignore`` as the model's vLLM modules are named (GPT-OSS'
        ``self_attn`` is vLLM's ``attn``), as compressed-tensors' config does; regexes and
        ``Linear`` are kept."""

        def renamed(names: list[str]) -> list[str]:
            mapped = [hf_to_vllm_mapper.map_name(name)
                      if "." in name and not name.startswith("re:") else name
                      for name in names]  # fmt: skip
            return [name for name in mapped if name is not None]

        self.targets, self.ignore = renamed(self.targets), renamed(self.ignore)
        if self.quantization is not None:
            self.quantization.apply_vllm_mapper(hf_to_vllm_mapper)

    def _compressed(self, name: str) -> bool:
        if any(_matches(name, pattern) for pattern in self.ignore):
            return False
        return any(_matches(name, pattern) for pattern in self.targets)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        parts = _fused_parts(prefix, self.packed_modules_mapping)
        chosen = {self._compressed(part) for part in parts}
        if len(chosen) > 1:
            raise ValueError(
                f"{prefix} fuses {', '.join(parts)}, of which only some are compressed "
                "2:4; vLLM loads them as one layer, so all or none must be"
            )
        compressed = chosen.pop()
        inner = UnquantizedLinearMethod()
        if self.quantization is not None:  # the chain's scheme for this layer
            self.quantization.packed_modules_mapping = self.packed_modules_mapping
            inner = self.quantization.get_quant_method(layer, prefix) or inner
        if isinstance(inner, UnquantizedLinearMethod):
            return Sparse24LinearMethod(prefix, get_current_vllm_config()) if compressed else inner
        return QuantizedChainLinearMethod(prefix, inner, compressed)


def _matches(name: str, pattern: str) -> bool:
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith(f".{pattern}")


def _fused_parts(prefix: str, mapping: dict[str, list[str]]) -> list[str]:
    """The checkpoint names behind vLLM's layer ``prefix`` (``qkv_proj`` is ``q_proj``,
    ``k_proj`` and ``v_proj``)."""
    head, _, last = prefix.rpartition(".")
    if last in (mapping or {}):
        return [f"{head}.{part}" if head else part for part in mapping[last]]
    return [prefix]
