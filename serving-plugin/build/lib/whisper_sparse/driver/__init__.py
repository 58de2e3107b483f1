"""The serving driver: runs in any environment with this plugin (``.venv``, beside
llmcompressor, or the serving environment itself) and drives vLLM in the serving
environment (``.venv-serve``) by subprocess.

* ``engine``: ``serve_command``, ``Server``, ``run_vllm``, ``serving_dtype``;
* ``cli``: ``whisper-serve``;
* ``vllm_worker``: the script ``run_vllm`` runs with the serving environment's Python.

What runs *inside* vLLM (the plugin, the compressed format, the kernels) is the rest of
``whisper_sparse``.
"""

from whisper_sparse.driver import engine as _engine
from whisper_sparse.driver.engine import *  # noqa: F403  (the driver's API)

__all__ = list(_engine.__all__)
