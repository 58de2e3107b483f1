"""What runs inside vLLM (and transformers) for sparse checkpoints: their compressed
layouts, the CPU and GPU engines that run them, and the adapters that plug them into vLLM
and transformers; installed into the serving environment alone (the driver that starts
vLLM from this package's environment is ``whisper_modifiers.serving``).

Imports only torch, safetensors, vLLM (``vllm_adapter``) and transformers
(``transformers_adapter``), never llmcompressor. Each part imports only those below it:

* ``paths`` (the cache directory, ``$WHISPER_MODIFIERS_CACHE``) and ``mode`` (the serving
  kernel mode, ``$WHISPER_MODIFIERS_SPARSE``);
* ``format/``: the layouts (2:4 and unstructured bitmask), their checks, and checkpoints
  rewritten in them;
* ``cpu/``: the CPU engine (native kernels, their build, the op, its plans, the modules);
* ``gpu/``: the GPU engine (cuSPARSELt's 2:4 GEMM, its dispatch plans, the modules);
* ``weight_bytes``: what a served model's sparse layers hold, counted;
* ``vllm_adapter/`` and ``transformers_adapter/``: the two adapters.
"""

from whisper_modifiers.sparse_serving.format.bits import CorruptCheckpointError
from whisper_modifiers.sparse_serving.format.declaration import QUANT_METHOD
from whisper_modifiers.sparse_serving.format.two_four import (
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
