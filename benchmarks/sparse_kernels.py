"""2:4 sparse GEMMs against dense on one GPU, in one run (``whisper_sparse.gpu.kernels``).

    python benchmarks/sparse_kernels.py                       # both sets
    python benchmarks/sparse_kernels.py --layers 8 --skip-per-shape

1. Per shape: Llama 7B / 8B / 70B projection shapes (vLLM's fused qkv and gate_up, o,
   down) × tokens 1…16384: dense ``F.linear`` against cuSPARSELt always sparse and against
   ``Sparse24Linear`` with its measured dispatch.
2. End to end: a Llama-7B-shaped ``LlamaForCausalLM`` (``--layers`` decoder layers,
   random weights pruned 2:4 by magnitude, bf16, SDPA attention) at batch × sequence from
   1×1 to 8×4096, one forward (logits of the last position, as a prefill computes): dense
   against ``accelerate(model)`` (dispatch) and against always sparse.

vLLM's engine, the compressed 2:4 checkpoint against the dense one, one engine per
process: ``vllm_speed.py``.

Every time is the median of CUDA-graph replays (eager timing where a forward cannot be
captured; the table says which). Ratios are dense time / other time: above 1 is faster.
Writes ``sparse_kernels.md``, ``sparse_kernels.json`` and ``sparse_kernels.png`` to
``--out``. On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS  # noqa: E402
from pruned_models import prune_24, pruned_llama  # noqa: E402
from sparse_kernels_report import write_tables  # noqa: E402

SHAPES = {  # (out, in) of each projection as vLLM runs it (qkv and gate_up fused)
    "7B": {
        "qkv": (12288, 4096),
        "o": (4096, 4096),
        "gate_up": (22016, 4096),
        "down": (4096, 11008),
    },
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70B": {
        "qkv": (10240, 8192),
        "o": (8192, 8192),
        "gate_up": (57344, 8192),
        "down": (8192, 28672),
    },
}
TOKENS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FORWARDS = [
    "1x1",
    "8x1",
    "64x1",
    "1x128",
    "1x512",
    "1x2048",
    "2x2048",
    "1x4096",
    "4x4096",
    "8x4096",
]


def per_shape(models, tokens, dtype) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from whisper_sparse.gpu import dispatch_plans, kernels

    rows = []
    for model in models:
        for name, (out_features, in_features) in SHAPES[model].items():
            weight = prune_24(torch.randn(out_features, in_features, device="cuda", dtype=dtype))
            dispatched = kernels.Sparse24Linear(weight)
            always = kernels.Sparse24Linear(weight, keep_dense=False, plan=dispatched.plan)
            for count in tokens:
                x = torch.randn(count, in_features, device="cuda", dtype=dtype)
                dense_ms = dispatch_plans._gpu_milliseconds(lambda: F.linear(x, weight))  # noqa: B023
                sparse_ms = dispatch_plans._gpu_milliseconds(lambda: always(x))  # noqa: B023
                dispatch_ms = dispatch_plans._gpu_milliseconds(lambda: dispatched(x))  # noqa: B023
                rows.append(
                    {
                        "model": model,
                        "projection": name,
                        "shape": [out_features, in_features],
                        "tokens": count,
                        "dense_ms": dense_ms,
                        "sparse_ms": sparse_ms,
                        "dispatch_ms": dispatch_ms,
                        "sparse_ratio": dense_ms / sparse_ms,
                        "dispatch_ratio": dense_ms / dispatch_ms,
                        "sparse_from": dispatched.plan.sparse_from,
                    }
                )
                print(
                    f"{model} {name:8s} {count:6d} tokens: dense {dense_ms:.4f} ms, "
                    f"sparse {dense_ms / sparse_ms:.2f}x, dispatch {dense_ms / dispatch_ms:.2f}x",
                    flush=True,
                )
            torch.cuda.empty_cache()
    return rows


def time_forward(model, batch: int, sequence: int) -> tuple[float, str]:
    import torch

    from whisper_sparse.gpu import dispatch_plans

    ids = torch.randint(0, model.config.vocab_size, (batch, sequence), device="cuda")

    def forward():
        return model(input_ids=ids, logits_to_keep=1, use_cache=False).logits

    with torch.no_grad():
        try:
            return dispatch_plans._gpu_milliseconds(forward, repeats=3, trials=5), "graph"
        except Exception:  # a forward that cannot be captured is timed eagerly
            torch.cuda.synchronize()
            for _ in range(2):
                forward()
            times = []
            for _ in range(5):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                forward()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times)[len(times) // 2], "eager"


def end_to_end(layers: int, forwards: list[str], dtype, compiled: bool) -> list[dict]:
    """Dense, dispatched and always-sparse forwards of one model, in ``transformers``'
    eager modules or under ``torch.compile`` (which fuses the norms, rotary embedding and
    activation as a serving engine's kernels do, leaving the GEMMs as they are)."""
    import torch

    from whisper_sparse.gpu import dispatch_plans, kernels

    model = pruned_llama(layers, dtype)
    print(f"attention: {model.config._attn_implementation}", flush=True)
    shapes = [tuple(int(v) for v in text.split("x")) for text in forwards]

    def measure():
        torch._dynamo.reset()
        run = torch.compile(model, dynamic=True) if compiled else model
        return {shape: time_forward(run, *shape) for shape in shapes}

    dense = measure()
    replaced = kernels.accelerate(model)
    print(f"accelerated {len(replaced)} Linear layers", flush=True)
    dispatched = measure()
    for module in model.modules():
        if isinstance(module, kernels.Sparse24Linear):
            module.plan = dispatch_plans.DispatchPlan.always_sparse(module.plan)
    always = measure()
    rows = []
    for shape in shapes:
        (dense_ms, mode), (dispatch_ms, _) = dense[shape], dispatched[shape]
        sparse_ms = always[shape][0]
        rows.append(
            {
                "batch": shape[0],
                "sequence": shape[1],
                "tokens": shape[0] * shape[1],
                "layers": layers,
                "compiled": compiled,
                "timing": mode,
                "dense_ms": dense_ms,
                "dispatch_ms": dispatch_ms,
                "sparse_ms": sparse_ms,
                "dispatch_ratio": dense_ms / dispatch_ms,
                "sparse_ratio": dense_ms / sparse_ms,
            }
        )
        print(
            f"forward {shape[0]}x{shape[1]} ({'compiled' if compiled else 'eager'}): dense "
            f"{dense_ms:.3f} ms, dispatch {dense_ms / dispatch_ms:.2f}x, always sparse "
            f"{dense_ms / sparse_ms:.2f}x ({mode})",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--forwards", nargs="+", default=FORWARDS, help="batch x sequence")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers end to end")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the forwards under torch.compile",
    )
    parser.add_argument("--skip-per-shape", action="store_true")
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.layers < 1 or min(args.tokens) < 1:
        parser.error("--layers and --tokens must be at least 1")

    import torch

    if not torch.cuda.is_available():
        print("sparse_kernels: no CUDA device here; nothing to measure (2:4 GEMMs need sm80+).")
        return 0
    from whisper_sparse.gpu import sparse_op

    if not sparse_op.sparse_kernel_available("cuda", torch.bfloat16):
        print(f"sparse_kernels: {torch.cuda.get_device_name()} has no cuSPARSELt 2:4 GEMM.")
        return 0
    dtype = torch.bfloat16
    payload = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cusparselt": torch.backends.cusparselt.version(),
        "dtype": "bfloat16",
    }
    if not args.skip_per_shape:
        payload["per_shape"] = per_shape(args.models, args.tokens, dtype)
    if not args.skip_end_to_end:
        payload["end_to_end"] = []
        for compiled in (False, True) if args.compile else (False,):
            payload["end_to_end"] += end_to_end(args.layers, args.forwards, dtype, compiled)
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    write_tables(args.out, payload)
    print((args.out / "sparse_kernels.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
