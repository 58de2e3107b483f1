"""The linear methods the vLLM plugin gives each layer of a compressed sparse checkpoint
(``SparseLinearMethod``, ``QuantizedChainLinearMethod``; ``vllm_adapter.config`` chooses
them); the loading of the stored tensors with their checks is ``vllm_adapter.loading``'s.

Imports vLLM at import time: only ``vllm_adapter.plugin.register`` imports it, once vLLM runs.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod

from whisper_sparse.cpu.fp8 import (
    EMULATED_FP8_NOTE,
    dequantized_fp8_weight,
    emulated_fp8,
)
from whisper_sparse.cpu.int8 import ExactInt8Linear, wants_exact_int8
from whisper_sparse.cpu.int8_op import int8_kernels
from whisper_sparse.cpu.linear import cpu_serving_kernel, cpu_serving_refusal
from whisper_sparse.format.declaration import TWO_FOUR_FORMAT
from whisper_sparse.gpu.kernels import serving_kernel
from whisper_sparse.heap import release_freed_heap
from whisper_sparse.mode import KERNEL_MODE_VARIABLE, kernel_mode
from whisper_sparse.vllm_adapter.compile_key import note_layer
from whisper_sparse.vllm_adapter.loading import (
    dense_of,
    register_compressed,
    take_stored,
)
from whisper_sparse.weight_bytes import DENSE_BYTES_ATTRIBUTE

__all__ = ["QuantizedChainLinearMethod", "SparseLinearMethod"]

# under vLLM's own logger, so that its handler prints these lines with its own (a logger
# outside the "vllm" namespace has no handler in a vLLM process and says nothing)
logger = init_logger(f"vllm.plugins.{__name__}")
LAYOUT_NAMES = {TWO_FOUR_FORMAT: "2:4"}  # others: "unstructured"


class _NotesCompileKey:
    """A linear method that records its layer's kernel mode and plan in vLLM's compile-cache
    key (``compile_key.note_layer``), where it was given the engine's config."""

    name: str
    vllm_config = None

    def _note(self, mode: str, plan: dict | None) -> None:
        if self.vllm_config is not None:
            note_layer(self.vllm_config, self.name, mode, plan)


class SparseLinearMethod(_NotesCompileKey, UnquantizedLinearMethod):
    """A layer loaded compressed in ``format`` (``vllm_adapter.loading``; merged layers and
    tensor-parallel shards load as the dense weight would), then run by, in this order:

    * on a CPU, the CPU op on this rank's compressed tensors (``cpu.linear``), where it
      runs here and, in the ``auto`` kernel mode, its measured plan beats dense at one
      token; the dense weight never exists;
    * 2:4 layers on sm80+ GPUs in 16-bit dtypes, cuSPARSELt's 2:4 GEMM with its measured
      dispatch (``gpu.kernels.serving_kernel``);
    * elsewhere, or in the ``dense`` mode (``$WHISPER_MODIFIERS_SPARSE``), vLLM's
      unquantized path on the decompressed weight."""

    def __init__(self, name: str, format: str = TWO_FOUR_FORMAT, vllm_config=None):
        super().__init__()
        self.name = name
        self.format = format
        self.vllm_config = vllm_config  # whose compile-cache key records the kernel

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        register_compressed(
            layer,
            self.name,
            self.format,
            input_size_per_partition,
            input_size,
            sum(output_partition_sizes),
            params_dtype,
            weight_loader,
            extra_weight_attrs,
        )

    def process_weights_after_loading(self, layer) -> None:
        self._process_weights(layer)
        release_freed_heap()  # the processing's temporaries (heap.py)

    def _process_weights(self, layer) -> None:
        rows, columns = layer.sparse_dense_shape
        stored = take_stored(layer)
        setattr(layer, DENSE_BYTES_ATTRIBUTE, rows * columns * stored[0].element_size())
        kernel = self._cpu_kernel(stored, columns)
        if kernel is not None:
            layer.sparse_kernel = kernel
            plan = kernel.plan
            self._note(
                kernel_mode(),
                {
                    "cpu_gemm_from": plan.gemm_from,
                    "cpu_lanes_until": plan.lanes_until,
                    "cpu_tiled_from": plan.tiled_from,
                    "cpu_brgemm_until": plan.brgemm_until,
                },
            )
            dtype = str(kernel.compressed.dtype).removeprefix("torch.")
            logger.info_once(
                f"{kernel.served.layout} CPU op, [{rows} x {columns}] {dtype} layers"
                f"{self._density(kernel)}: {plan.describe()}"
            )
            return
        weight = dense_of(stored, (rows, columns), self.name)
        del stored
        kernel = serving_kernel(weight) if self.format == TWO_FOUR_FORMAT else None
        self._note(kernel_mode(), None if kernel is None else asdict(kernel.plan))
        if kernel is None or kernel.dense is not None:
            layer.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
        if kernel is None:
            super().process_weights_after_loading(layer)
        else:
            layer.sparse_kernel = kernel

    @staticmethod
    def _density(kernel) -> str:
        density = kernel.density()
        return "" if density is None else f" keeping {round(100 * density)} %"

    def _cpu_kernel(self, stored, columns: int):
        """The CPU op's module over this rank's tensors, or None; on a CPU where the op
        cannot run, says why once."""
        compressed, bitmask, row_offsets = stored
        if compressed.device.type != "cpu":
            return None
        layout = LAYOUT_NAMES.get(self.format, "unstructured")
        refusal = cpu_serving_refusal(compressed.device, compressed.dtype)
        if refusal is not None:
            logger.info_once(f"{layout} layers run decompressed to dense on this CPU: {refusal}")
            return None
        kernel = cpu_serving_kernel(compressed, bitmask, columns, self.name, row_offsets)
        if kernel is None:
            logger.info_once(
                f"{layout} layers whose measured CPU op was slower than dense at "
                f"one token run dense (set {KERNEL_MODE_VARIABLE}=sparse to keep "
                "them compressed)"
            )
        return kernel

    def apply(self, layer, x, bias=None):
        kernel = getattr(layer, "sparse_kernel", None)
        if kernel is None:
            return super().apply(layer, x, bias)
        return kernel.linear(x, bias)


class QuantizedChainLinearMethod(_NotesCompileKey, LinearMethodBase):
    """A W8A8 / FP8 chain's quantized layer: compressed-tensors' scheme for this layer
    (``inner``, vLLM's own kernels); if ``compressed``, its quantized weight is loaded
    compressed and decompressed before the scheme processes it. Where vLLM's kernel for the
    layer would not compute well on this CPU, the plugin's replacement runs instead:
    ``cpu.int8.ExactInt8Linear`` where the oneDNN int8 GEMM saturates, and the weight
    dequantized to the model's dtype (``cpu.fp8``) where FP8 has only the emulated path.
    A compressed W8A8 layer on a CPU runs the W8A8 op on its stored int8 values instead
    (``vllm_adapter.w8a8``), where its plan says so. ``format``: the stored weight's
    compressed layout (None: stored dense)."""

    def __init__(self, name: str, inner, format: str | None = TWO_FOUR_FORMAT, vllm_config=None):
        self.name = name
        self.inner = inner
        self.format = format  # of the stored weight; None: stored dense
        self.vllm_config = vllm_config  # whose compile-cache key records the W8A8 op's plan

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        self.inner.create_weights(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            params_dtype,
            **extra_weight_attrs,
        )
        layer.sparse_params_dtype = params_dtype
        if self.format is None:
            return
        quantized = layer.weight  # the scheme's [out, in] int8 / float8 parameter
        del layer.weight
        layer.sparse_weight_class = type(quantized)
        extra = {k: v for k, v in extra_weight_attrs.items() if k != "weight_loader"}
        register_compressed(
            layer,
            self.name,
            self.format,
            input_size_per_partition,
            input_size,
            sum(output_partition_sizes),
            quantized.dtype,
            extra_weight_attrs["weight_loader"],
            extra,
        )

    def process_weights_after_loading(self, layer) -> None:
        self._process_weights(layer)
        release_freed_heap()  # the processing's temporaries (heap.py)

    def _process_weights(self, layer) -> None:
        if self.format is not None:
            stored = take_stored(layer)
            rows, columns = layer.sparse_dense_shape
            setattr(layer, DENSE_BYTES_ATTRIBUTE, rows * columns * stored[0].element_size())
            if self._w8a8_op(layer, stored):
                return
            weight = dense_of(stored, layer.sparse_dense_shape, self.name)
            del stored
            try:  # vLLM's parameter class for it, as the scheme created it
                parameter = layer.sparse_weight_class(
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
            dtype = layer.sparse_params_dtype
            dense = dequantized_fp8_weight(weight, layer.weight_scale.data, widths, dtype)
            logger.warning_once(
                EMULATED_FP8_NOTE.format(
                    kernel=type(layer.scheme.fp8_linear).__name__, dtype=str(dtype).split(".")[-1]
                )
            )
            for name in ("weight", "weight_scale", "input_scale"):
                if hasattr(layer, name):
                    delattr(layer, name)
            layer.register_parameter("weight", torch.nn.Parameter(dense, requires_grad=False))
            layer.dequantized_fp8 = UnquantizedLinearMethod()
            layer.dequantized_fp8.process_weights_after_loading(layer)
            return
        self.inner.process_weights_after_loading(layer)

    def _w8a8_op(self, layer, stored) -> bool:
        """Whether the W8A8 op now serves the layer from its stored int8 values (on a CPU
        where it runs and, in the ``auto`` mode, its plan beat vLLM's dense W8A8 layer at one
        token); it says each shape's plan once."""
        if stored[0].dtype != torch.int8 or stored[0].device.type != "cpu":
            return False
        from whisper_sparse.vllm_adapter.w8a8 import w8a8_op_layer

        served = w8a8_op_layer(layer, stored)
        rows, columns = layer.sparse_dense_shape
        layout = LAYOUT_NAMES.get(self.format, "unstructured")
        if served is None:
            self._note(kernel_mode(), None)
            logger.info_once(
                f"{layout} W8A8 [{rows} x {columns}] layers run as vLLM's dense int8 layer "
                f"(W8A8 CPU kernels here: {int8_kernels()}, kernel mode {kernel_mode()})"
            )
            return False
        layer.w8a8_op = served
        self._note(kernel_mode(), {"cpu_int8_tiled_from": served.plan.tiled_from})
        density = served.density()
        kept = "" if density is None else f" keeping {round(100 * density)} %"
        logger.info_once(
            f"{layout} W8A8 CPU op, [{rows} x {columns}] int8 layers{kept}, rounding as vLLM's "
            f"{served.rounding} kernel: "
            f"{served.plan.describe().replace('dense time', 'dense W8A8 time')}"
        )
        return True

    def apply(self, layer, x, bias=None):
        w8a8 = getattr(layer, "w8a8_op", None)
        if w8a8 is not None:
            return w8a8.linear(x, bias)
        exact = getattr(layer, "exact_int8", None)
        if exact is not None:
            return exact(x, bias)
        dequantized = getattr(layer, "dequantized_fp8", None)
        if dequantized is not None:
            return dequantized.apply(layer, x, bias)
        return self.inner.apply(layer, x, bias)
