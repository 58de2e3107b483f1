"""The serving side of 2:4 checkpoints: their compressed format, GPU kernels and the vLLM plugin.

Imports only torch, safetensors, vLLM (``vllm_plugin``) and transformers
(``transformers_quantizer``), never llmcompressor: it installs into the serving
environment alone.

* ``format``: compress and decompress 2:4 weights (values + 4-bit-per-group bitmask);
* ``checkpoint``: write a saved checkpoint's 2:4 Linear weights in that layout and
  declare it in ``config.json``; read such a checkpoint back as a dense state dict;
* ``paths``: the package's cache directory (``$WHISPER_MODIFIERS_CACHE``);
* ``kernels``: 2:4 GEMMs on sm80+ GPUs (cuSPARSELt) with a measured dispatch to dense,
  as ``Sparse24Linear`` and ``accelerate(model)``;
* ``vllm_plugin``: the ``vllm.general_plugins`` entry point that registers the format
  with vLLM (and runs its layers through ``kernels``);
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
