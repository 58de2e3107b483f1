"""The serving side of 2:4 checkpoints: their compressed format and the vLLM plugin.

Imports only torch, safetensors, vLLM (``vllm_plugin``) and transformers
(``transformers_quantizer``), never llmcompressor: it installs into the serving
environment alone.

* ``format``: compress and decompress 2:4 weights (values + 4-bit-per-group bitmask);
* ``checkpoint``: write a saved checkpoint's 2:4 Linear weights in that layout and
  declare it in ``config.json``; read such a checkpoint back as a dense state dict;
* ``vllm_plugin``: the ``vllm.general_plugins`` entry point that registers the format
  with vLLM;
* ``transformers_quantizer``: the format in transformers' quantizer registry
  (``import whisper_modifiers`` registers it).
"""

from whisper_modifiers.sparse_serving.format import (
    QUANT_METHOD,
    NotTwoFourError,
    check_two_four,
    compress_24,
    decompress_24,
)

__all__ = ["QUANT_METHOD", "NotTwoFourError", "check_two_four", "compress_24", "decompress_24"]
