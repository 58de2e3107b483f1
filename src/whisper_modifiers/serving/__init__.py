"""The serving driver: runs in this package's environment (``.venv``, with llmcompressor)
and drives vLLM in the serving environment (``.venv-serve``) by subprocess.

* ``engine``: ``serve_command``, ``Server``, ``run_vllm``, ``serving_dtype``;
* ``cli``: ``whisper-serve``;
* ``vllm_worker``: the script ``run_vllm`` runs with the serving environment's Python.

What runs *inside* vLLM (the plugin, the compressed format, the kernels) is the
``sparse_serving`` subpackage, which is installed into ``.venv-serve`` alone.
"""

from whisper_modifiers.serving import engine as _engine
from whisper_modifiers.serving.engine import *  # noqa: F403  (the driver's API)

__all__ = list(_engine.__all__)
