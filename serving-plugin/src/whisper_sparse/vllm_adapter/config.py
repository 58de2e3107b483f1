"""The quantization config that ``vllm_adapter.plugin.register`` registers with vLLM for
compressed sparse checkpoints (``format.declaration``): which layers are stored in which
layout, and the linear method each layer gets (``vllm_adapter.layers``).

Imports vLLM at import time: only ``vllm_adapter.plugin.register`` imports it, once vLLM runs.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from whisper_sparse.format.declaration import (
    BITMASK_FORMAT,
    LEGACY_QUANT_METHOD,
    QUANT_METHOD,
    TWO_FOUR_FORMAT,
    is_compressed_checkpoint,
    is_ours,
    targets_by_format,
)
from whisper_sparse.vllm_adapter.layers import (
    QuantizedChainLinearMethod,
    SparseLinearMethod,
)

__all__ = ["LegacySparseConfig", "SparseConfig"]


class SparseConfig(QuantizationConfig):
    """Compressed sparse Linear weights: ``targets`` by stored layout (names, ``re:``
    patterns, or ``Linear`` for every one but ``ignore``), with a W8A8 / FP8 chain's
    compressed-tensors config where the stored values are quantized."""

    linear_method = SparseLinearMethod

    def __init__(self, targets: dict[str, list[str]], ignore: list[str], quantization=None):
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
    def from_config(cls, config: dict[str, Any]) -> SparseConfig:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
            CompressedTensorsConfig,
        )

        targets, ignore = targets_by_format(config)
        nested = config.get("quantization_config") if is_ours(config) else None
        return cls(targets, ignore, CompressedTensorsConfig.from_config(nested) if nested else None)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, **kwargs):
        quantization = hf_quant_cfg or {}
        if not is_ours(quantization) and is_compressed_checkpoint(
            {"quantization_config": quantization}
        ):
            return QUANT_METHOD  # the unquantized legacy layouts are ours
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """Rename the targets and ``ignore`` as the model's vLLM modules are named (GPT-OSS'
        ``self_attn`` is vLLM's ``attn``), as compressed-tensors' config does; regexes and
        ``Linear`` are kept."""

        def renamed(names: list[str]) -> list[str]:
            mapped = [
                hf_to_vllm_mapper.map_name(name)
                if "." in name and not name.startswith("re:")
                else name
                for name in names
            ]
            return [name for name in mapped if name is not None]

        self.targets = {format: renamed(names) for format, names in self.targets.items()}
        self.ignore = renamed(self.ignore)
        if self.quantization is not None:
            self.quantization.apply_vllm_mapper(hf_to_vllm_mapper)

    def _format(self, name: str) -> str | None:
        """The stored layout of checkpoint layer ``name`` (None: stored dense)."""
        if any(_matches(name, pattern) for pattern in self.ignore):
            return None
        for format in (TWO_FOUR_FORMAT, BITMASK_FORMAT):
            if any(_matches(name, pattern) for pattern in self.targets.get(format, [])):
                return format
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        parts = _fused_parts(prefix, self.packed_modules_mapping)
        chosen = {self._format(part) for part in parts}
        if len(chosen) > 1:
            raise ValueError(
                f"{prefix} fuses {', '.join(parts)}, which are stored in different layouts "
                f"({', '.join(sorted(str(f or 'dense') for f in chosen))}); vLLM loads them "
                "as one layer, so all must be stored alike"
            )
        format = chosen.pop()
        inner = UnquantizedLinearMethod()
        if self.quantization is not None:  # the chain's scheme for this layer
            self.quantization.packed_modules_mapping = self.packed_modules_mapping
            inner = self.quantization.get_quant_method(layer, prefix) or inner
        if isinstance(inner, UnquantizedLinearMethod):
            if format is None:
                return inner
            return SparseLinearMethod(prefix, format, get_current_vllm_config())
        return QuantizedChainLinearMethod(prefix, inner, format, get_current_vllm_config())


class LegacySparseConfig(SparseConfig):
    """The same config under the method's name before unstructured layers, so that
    checkpoints written then load."""

    @classmethod
    def get_name(cls) -> str:
        return LEGACY_QUANT_METHOD

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, **kwargs):
        return None  # the legacy compressed-tensors layouts go to SparseConfig


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
