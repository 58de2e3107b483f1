"""The serving driver: runs in this package's environment (``.venv``, with llmcompressor)
and drives vLLM in the serving environment (``.venv-serve``) by subprocess.

* ``engine``: ``serve_command``, ``Server``, ``run_vllm``, ``serving_dtype``;
* ``cli``: ``whisper-serve``;
* ``vllm_worker``: the script ``run_vllm`` runs with the serving environment's Python.

What runs *inside* vLLM (the plugin, the compressed format, the kernels) is the
``sparse_serving`` subpackage, which is installed into ``.venv-serve`` alone.
"""

from whisper_modifiers.serving.engine import (
    SERVING_PYTHON_ENV,
    Server,
    ServingUnavailable,
    quantized_layers,
    run_vllm,
    scores_perplexity,
    serve_command,
    serving_dtype,
    serving_env,
    serving_python,
    vllm_perplexity,
)

__all__ = [
    "SERVING_PYTHON_ENV",
    "Server",
    "ServingUnavailable",
    "quantized_layers",
    "run_vllm",
    "scores_perplexity",
    "serve_command",
    "serving_dtype",
    "serving_env",
    "serving_python",
    "vllm_perplexity",
]
