"""The vLLM side of compressed 2:4 checkpoints: the quantization config and linear
methods that ``vllm_plugin.register`` registers with vLLM (see its docstring), and the
loading of the compressed tensors with their checks.

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
from whisper_modifiers.sparse_serving.format import (
    QUANT_METHOD,
    CorruptCheckpointError,
    decompress_24,
)
from whisper_modifiers.sparse_serving.kernels import kernel_mode, serving_kernel

__all__ = [
    "QuantizedChainLinearMethod",
    "Sparse24Config",
    "Sparse24LinearMethod",
    "sparse24_dense_weight",
]

_LEGACY_FORMAT = "sparse-24-bitmask"
logger = init_logger(__name__)


class Sparse24LinearMethod(UnquantizedLinearMethod):
    """2:4 weights loaded compressed, decompressed after loading."""

    def __init__(self, name: str, vllm_config=None):
        super().__init__()
        self.name = name
        self.vllm_config = vllm_config  # whose compile-cache key records the kernel

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype,
                       **extra_weight_attrs):  # fmt: skip
        weight_loader = extra_weight_attrs.pop("weight_loader")
        _register_compressed(layer, self.name, input_size_per_partition, input_size,
                             sum(output_partition_sizes), params_dtype, weight_loader,
                             extra_weight_attrs)  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        weight = _take_dense_weight(layer)
        kernel = serving_kernel(weight)
        if self.vllm_config is not None:
            plan = None if kernel is None else asdict(kernel.plan)
            note_layer(self.vllm_config, self.name, kernel_mode(), plan)
        if kernel is None or kernel.dense is not None:
            layer.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
        if kernel is None:
            super().process_weights_after_loading(layer)
        else:
            layer.sparse24_kernel = kernel

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
        _register_compressed(layer, self.name, input_size_per_partition, input_size,
                             sum(output_partition_sizes), quantized.dtype,
                             extra_weight_attrs["weight_loader"], extra)  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        if self.compressed:
            weight = _take_dense_weight(layer)
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


def _register_compressed(layer, name, input_size_per_partition, input_size, rows, dtype,
                         weight_loader, extra_weight_attrs) -> None:  # fmt: skip
    """``compressed`` / ``bitmask`` / ``shape`` parameters on ``layer``, loaded by vLLM's
    own (v1) loader of the layer: rows are outputs, so merged and column shards are row
    ranges, and a row-parallel shard narrows the columns (whole groups and bytes only)."""
    if input_size % 4:
        raise ValueError(
            f"{name}: {input_size} inputs are not a multiple of 4, so the layer cannot be "
            "2:4; the checkpoint's targets are wrong"
        )
    if input_size_per_partition != input_size and input_size_per_partition % 8:
        raise ValueError(
            f"{name}: its tensor-parallel shard holds {input_size_per_partition} of "
            f"{input_size} inputs, which splits groups of four (or bitmask bytes) of the "
            "compressed 2:4 weight; use a tensor-parallel size that divides the input size "
            "into multiples of 8"
        )
    layer.sparse24_stored_rows = {}  # (part, checkpoint part) -> rows, checked after loading
    for part, columns, part_dtype in (
        ("compressed", input_size_per_partition // 2, dtype),
        ("bitmask", -(-input_size_per_partition // 8), torch.uint8),  # whole bytes per row
    ):
        parameter = torch.nn.Parameter(torch.empty(rows, columns, dtype=part_dtype),
                                       requires_grad=False)  # fmt: skip
        layer.register_parameter(part, parameter)
        parameter.output_dim, parameter.input_dim = 0, 1
        stored_columns = input_size // 2 if part == "compressed" else -(-input_size // 8)
        parameter.weight_loader = _checked_loader(layer, part, stored_columns, weight_loader)
        for key, value in extra_weight_attrs.items():
            setattr(parameter, key, value)
    shape = torch.nn.Parameter(torch.empty(2, 1, dtype=torch.int64), requires_grad=False)
    shape.weight_loader = _checked_loader(layer, "shape", 1, None)  # known from the layer
    layer.register_parameter("shape", shape)
    layer.sparse24_dense_shape = (rows, input_size_per_partition)
    layer.sparse24_input_size = input_size
    layer.sparse24_name = name


def _checked_loader(layer, part, columns, weight_loader):
    """``weight_loader`` (vLLM's own, of the layer) for the checkpoint tensor ``part``,
    after checking its columns (the layer's whole input size, compressed), so a tensor of
    the wrong shape is an error naming the layer and the tensor rather than vLLM's bare
    ``AssertionError``. The rows of every stored tensor are recorded by checkpoint part
    (``q``/``k``/``v``, gate/up, or the whole layer) and compared in ``_take_dense_weight``."""

    def load(param, loaded_weight, shard=None, *args, **kwargs):
        name = f"{layer.sparse24_name}.{part}" + ("" if shard is None else f" (part {shard})")
        if part == "shape":
            stored = loaded_weight.reshape(-1).tolist()
            if len(stored) != 2 or stored[1] != layer.sparse24_input_size:
                raise CorruptCheckpointError(
                    f"{name} is {stored}: the layer has {layer.sparse24_input_size} inputs"
                )
            layer.sparse24_stored_rows[(part, shard)] = stored[0]
            return
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != columns:
            raise CorruptCheckpointError(
                f"{name} has shape {list(loaded_weight.shape)}; the layer's "
                f"{layer.sparse24_input_size} inputs need [rows, {columns}]"
            )
        layer.sparse24_stored_rows[(part, shard)] = loaded_weight.shape[0]
        try:
            weight_loader(
                param, loaded_weight, *(() if shard is None else (shard,)), *args, **kwargs
            )
        except AssertionError as error:  # vLLM's shape assertion, on the rows
            raise CorruptCheckpointError(
                f"{name} has shape {list(loaded_weight.shape)}, which does not fit the "
                f"layer's {list(param.shape)}"
            ) from error

    return load


def _check_stored_rows(layer) -> None:
    """Every checkpoint part's ``compressed``, ``bitmask`` and ``shape`` agree on its rows."""
    by_shard: dict = {}
    for (part, shard), rows in layer.sparse24_stored_rows.items():
        by_shard.setdefault(shard, {})[part] = rows
    for shard, rows in by_shard.items():
        if len(set(rows.values())) != 1 or len(rows) != 3:
            suffix = "" if shard is None else f" (part {shard})"
            raise CorruptCheckpointError(
                f"{layer.sparse24_name}{suffix}: the stored compressed / bitmask / shape "
                f"tensors disagree on the rows or one is missing: {rows}"
            )


def _take_dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    _check_stored_rows(layer)
    weight = sparse24_dense_weight(layer)
    for part in ("compressed", "bitmask", "shape"):
        delattr(layer, part)
    return weight


def sparse24_dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A loaded 2:4 layer's dense weight (in the dtype it was stored in), from which
    ``serving_kernel`` compresses cuSPARSELt's operand."""
    return decompress_24(layer.compressed.data, layer.bitmask.data, layer.sparse24_dense_shape,
                         getattr(layer, "sparse24_name", "weight"))  # fmt: skip
