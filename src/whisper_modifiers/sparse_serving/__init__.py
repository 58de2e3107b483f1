"""What runs inside vLLM (and transformers) for 2:4 checkpoints: their compressed format,
GPU kernels and the vLLM plugin; installed into the serving environment alone (the driver
that starts vLLM from this package's environment is ``whisper_modifiers.serving``).

Imports only torch, safetensors, vLLM (``vllm_plugin``) and transformers
(``transformers_quantizer``), never llmcompressor: it installs into the serving
environment alone.

* ``format``: compress and decompress 2:4 weights (values + 4-bit-per-group bitmask);
* ``layout``: write a saved checkpoint's 2:4 Linear weights in that layout and
  declare it in ``config.json``; read such a checkpoint back as a dense state dict;
* ``paths``: the package's cache directory (``$WHISPER_MODIFIERS_CACHE``);
* ``sparse_op``: cuSPARSELt's 2:4 GEMM on sm80+ GPUs as one ``torch.library`` op;
* ``dispatch_plans``: from which token count it beats dense, measured and cached;
* ``kernels``: ``Sparse24Linear``, ``accelerate(model)`` and the serving kernel mode;
* ``vllm_plugin``: the ``vllm.general_plugins`` entry point that registers the format
  with vLLM; ``vllm_layers``: its config and linear methods (which run ``kernels``),
  ``vllm_loading``: the compressed tensors loaded and checked in vLLM; ``cpu_int8`` and
  ``cpu_fp8``: what the plugin runs where vLLM's CPU kernels fall short;
* ``compile_key``: the plugin's part of vLLM's compile-cache key;
* ``transformers_quantizer``: the format in transformers' quantizer registry
  (``import whisper_modifiers`` registers it).
"""

from whisper_modifiers.sparse_serving.format import (
    QUANT_METHOD,
    CorruptCheckpointError,
    NotTwoFourError,
    check_two_four,
    compress_24,
    decompress_24,
)

__all__ = [
    "QUANT_METHOD",
    "CorruptCheckpointError",
    "NotTwoFourError",
    "check_two_four",
    "compress_24",
    "decompress_24",
]
