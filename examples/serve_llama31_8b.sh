#!/usr/bin/env bash
# The whole path on a real model: Whisper 2:4 + FP8 in one recipe -> a compressed-tensors
# checkpoint -> vLLM's OpenAI-compatible server -> a request.
# Needs a GPU machine with Hugging Face hub access (Llama 3.1 is gated: accept its licence
# and log in with `hf auth login` first). FP8 kernels need compute capability >= 8.9 for
# FP8 activations (older GPUs fall back to FP8 weights only).
#
#     bash examples/serve_llama31_8b.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-meta-llama/Llama-3.1-8B}
OUT=${OUT:-outputs/Llama-3.1-8B-whisper_2of4_fp8}
PORT=${PORT:-8000}

bash scripts/setup.sh                             # pruning environment: .venv
VLLM_PACKAGE=vllm bash scripts/setup_serving.sh   # serving environment: .venv-serve

# The paper's calibration (128 x 2048 WikiText-2 train tokens); WikiText-2 test perplexity.
.venv/bin/whisper-prune --model "$MODEL" --recipe whisper_2of4_fp8 --output-dir "$OUT" \
    --calibration wikitext2 --num-sequences 128 --seq-len 2048 \
    --eval-text wikitext2 --eval-seq-len 2048 --eval-windows 0

# Serve. On a GPU machine this is the same as `.venv-serve/bin/vllm serve "$OUT"`;
# whisper-serve checks the checkpoint first and also works with the CPU package.
.venv/bin/whisper-serve "$OUT" --port "$PORT" --max-model-len 4096 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 180); do  # at most 15 minutes for start-up
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 5
done
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' -d "{
    \"model\": \"$(realpath "$OUT")\", \"prompt\": \"The capital of France is\",
    \"max_tokens\": 32, \"temperature\": 0}"
echo
