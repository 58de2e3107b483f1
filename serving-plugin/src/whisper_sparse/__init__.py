"""whisper-sparse: compressed sparse checkpoints served in vLLM and transformers, kept
compressed where a kernel runs them. Installed next to vLLM (``pip install
./serving-plugin``), beside whisper-modifiers, whose save path writes the format through it.

Imports only torch, safetensors, vLLM (``vllm_adapter``) and transformers
(``transformers_adapter``), never llmcompressor. Each part imports only those below it:

* ``paths`` (the cache directory, ``$WHISPER_MODIFIERS_CACHE``) and ``mode`` (the serving
  kernel mode, ``$WHISPER_MODIFIERS_SPARSE``);
* ``format/``: the layouts (2:4 and unstructured bitmask), their checks, and checkpoints
  rewritten in them;
* ``cpu/``: the CPU engine (native kernels, their build, the sparse CPU op, the served
  layers, their plans, the modules);
* ``gpu/``: the GPU engine (cuSPARSELt's 2:4 GEMM, its dispatch plans, the modules);
* ``weight_bytes``: what a served model's sparse layers hold, counted;
* ``vllm_adapter/`` and ``transformers_adapter/``: the two adapters;
* ``driver/``: ``whisper-serve``, which starts vLLM's server by subprocess.

Importing it registers the formats with transformers' quantizer registry, where
transformers is installed (vLLM finds the plugin by its ``vllm.general_plugins`` entry point).
"""

import importlib.util

from whisper_sparse.format.bits import CorruptCheckpointError
from whisper_sparse.format.declaration import QUANT_METHOD
from whisper_sparse.format.two_four import (
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

if importlib.util.find_spec("transformers") is not None:
    from whisper_sparse.transformers_adapter.quantizer import register as _register

    _register()
