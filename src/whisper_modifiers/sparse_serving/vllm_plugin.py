"""vLLM plugin: serve compressed 2:4 checkpoints (``format``'s layout).

Installed as the ``vllm.general_plugins`` entry point ``whisper_modifiers_sparse24``;
vLLM calls ``register`` in every process, which registers ``Sparse24Config`` under
``QUANT_METHOD`` with ``register_quantization_config``. The config also claims, through
``override_quantization_method``, unquantized checkpoints in compressed-tensors' legacy
``sparse-24-bitmask`` format (compressed-tensors < 0.15), which stock vLLM refuses: the
tensors have the same layout.

``Sparse24LinearMethod`` creates the compressed parameters (``compressed``, ``bitmask``,
``shape``) with vLLM's own weight loaders, so merged layers (qkv, gate_up) and
tensor-parallel shards load as the dense weight would: rows are outputs, so output
shards are row ranges; an input (row-parallel) shard must hold whole bytes of the bitmask
(a multiple of 8 inputs), else loading stops with an error naming the layer. After
loading, ``process_weights_after_loading`` decompresses to the dense weight and hands it
to ``kernels.serving_kernel``: on sm80+ GPUs in 16-bit dtypes, cuSPARSELt's 2:4 GEMM with
its measured dispatch to dense below the token counts where sparse loses
(``$WHISPER_MODIFIERS_SPARSE24`` = auto / sparse / dense); elsewhere (CPU, float32) to
vLLM's unquantized path (``UnquantizedLinearMethod``). In a W8A8 / FP8 chain (whose
compressed-tensors config is nested in ours) the dense 8-bit weight goes to
compressed-tensors' scheme for the layer with its int8 / float8 kernels
(``QuantizedChainLinearMethod``), except an int8 layer on a CPU whose oneDNN int8 GEMM
saturates (no VNNI), which ``cpu_int8.ExactInt8Linear`` computes exactly, and an FP8
layer on a CPU where vLLM has only its emulated FP8 path, which gets its weight
dequantized to the model's dtype (``cpu_fp8``; no FP8 arithmetic runs); no 8-bit 2:4
kernel is used yet.

The config and linear methods are module-level classes in ``vllm_layers``, which imports
vLLM; ``register`` imports it only when vLLM calls it.
"""

from __future__ import annotations

from whisper_modifiers.sparse_serving.format import QUANT_METHOD
from whisper_modifiers.sparse_serving.kernels import kernel_mode

__all__ = ["register"]

_registered = False


def register() -> None:
    """The entry point: register the quantization config with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    kernel_mode()  # a bad $WHISPER_MODIFIERS_SPARSE24 stops vLLM before any weight loads
    from vllm.model_executor.layers.quantization import register_quantization_config

    from whisper_modifiers.sparse_serving.vllm_layers import Sparse24Config

    register_quantization_config(QUANT_METHOD)(Sparse24Config)
    _registered = True
