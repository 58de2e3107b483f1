"""The serving path, small enough for a CPU (the small version of serve_llama31_8b.sh):
prune the embedded SmolLM2-135M with Whisper 2:4 + W8A8 int8 in one recipe, save the
checkpoint, serve it with vLLM's OpenAI-compatible server on 127.0.0.1, send a few
requests, stop the server.

    bash scripts/setup.sh && bash scripts/setup_serving.sh
    .venv/bin/python examples/serve_small.py [OUTPUT_DIR] [MODEL]

MODEL is a model directory or hub id to prune instead of the embedded SmolLM2 (the tests
pass SmolLM2 cut to 4 layers).

Offline: the model and the calibration text ship with the packages. (stories260K, the
test model, cannot be served by vLLM on CPU: its head size, 8, is below the CPU attention
kernels' smallest, 32.)
"""

import sys
import tempfile
from pathlib import Path

from whisper_modifiers.cli import main as whisper_prune
from whisper_sparse.driver import Server

output_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "ckpt"
model = ["--model", sys.argv[2]] if len(sys.argv) > 2 else []  # default: the embedded model
# 1. prune + quantize (calibration: 16 x 256 tokens of the embedded text)
status = whisper_prune(
    [
        *model,
        "--recipe",
        "whisper_2of4_w8a8",
        "--output-dir",
        str(output_dir),
        "--overwrite",
        "--num-sequences",
        "16",
        "--seq-len",
        "256",
        "--eval-windows",
        "2",
        "--skip-dense-eval",
    ]
)
if status:
    sys.exit(status)
# 2. serve, 3. request, 4. stop (on leaving the block)
with Server(output_dir, max_model_len=512) as server:
    print(f"\nserving {output_dir} at {server.url}:\n  " + " ".join(server.command))
    for prompt in ["The capital of France is", "def fibonacci(n):"]:
        answer = server.complete(prompt, max_tokens=24)
        print(f"\n{prompt!r} -> {answer['choices'][0]['text']!r}")
