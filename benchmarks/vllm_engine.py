"""One vLLM engine, in its own process: throughput per workload, what its 2:4 layers hold
for their weights, and where its time goes (``torch.profiler`` inside the engine).

    python benchmarks/vllm_engine.py CHECKPOINT --label sparse24 --mode sparse --out r.json
    python benchmarks/vllm_engine.py CHECKPOINT --profile --max-cudagraph-capture-size 2048

Run it with the serving environment's Python (vLLM and this package's plugin).
``benchmarks/vllm_speed.py`` runs one per checkpoint and kernel mode: a deleted engine does
not give its GPU memory back, so a second engine in the same process fails its memory
check. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
profiler sees its forward passes and ``LLM.apply_model`` reaches its layers. It runs as vLLM
runs by default (CUDA graphs on a GPU, the model compiled by torch.compile on a CPU) unless
given ``--enforce-eager``.

Workloads are ``prefill:NxL`` (N random prompts of L tokens, one token generated; prompt
tokens counted) and ``decode:NxT`` (N prompts of 16 tokens, T tokens generated each, all
counted). Each is timed ``--repeats`` times after a warm-up; the median is reported.
``--profile`` profiles one more run of each workload and keeps the ops with the most self
time (device time where there is a GPU), and the calls of the sparse ops (the GPU 2:4 op and
cuSPARSELt's GEMM; the CPU op's 2:4 and unstructured layers) with their CPU time per call
(where a plan built at every eager call would show).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from whisper_sparse.mode import KERNEL_MODE_VARIABLE, KERNEL_MODES
from whisper_sparse.vllm_adapter.compile_key import compilation_mode

DECODE_PROMPT = 16  # prompt tokens of a decode workload's sequences
DEFAULT_WORKLOADS = ["prefill:32x2048", "decode:1x128", "decode:64x256", "decode:256x128"]
# the GPU 2:4 op, cuSPARSELt's GEMM, and the CPU op (its 2:4 and unstructured layers)
WATCHED_OPS = ("sparse24_linear", "_cslt_sparse_mm", "whisper_sparse_cpu::")


@dataclass(frozen=True)
class Workload:
    kind: str  # "prefill" or "decode"
    sequences: int
    tokens: int  # prompt length (prefill) or tokens generated (decode)

    @classmethod
    def parse(cls, text: str) -> Workload:
        kind, _, shape = text.partition(":")
        sequences, _, tokens = shape.partition("x")
        if kind not in ("prefill", "decode") or not (sequences.isdigit() and tokens.isdigit()):
            raise ValueError(
                f"workload {text!r} is not prefill:NxL or decode:NxT (e.g. "
                "prefill:32x2048, decode:64x256)"
            )
        if int(sequences) < 1 or int(tokens) < 1:
            raise ValueError(f"workload {text!r}: N and the token count must be at least 1")
        return cls(kind, int(sequences), int(tokens))

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.sequences}x{self.tokens}"

    @property
    def prompt_len(self) -> int:
        return self.tokens if self.kind == "prefill" else DECODE_PROMPT

    @property
    def max_tokens(self) -> int:
        return 1 if self.kind == "prefill" else self.tokens

    @property
    def counted_tokens(self) -> int:
        return self.sequences * self.tokens


def check_workloads(parser: argparse.ArgumentParser, texts: list[str]) -> None:
    """Stop with the parser's error on a bad ``--workloads`` entry, before any engine."""
    for text in texts:
        try:
            Workload.parse(text)
        except ValueError as error:
            parser.error(f"--workloads: {error}")


def prompts_for(workload: Workload, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    shape = (workload.sequences, workload.prompt_len)
    return torch.randint(0, vocab, shape, generator=generator).tolist()


def engine_arguments(args, workloads: list[Workload], on_gpu: bool) -> dict:
    """The ``vllm.LLM`` keyword arguments for these options and workloads."""
    longest = max(w.prompt_len + w.max_tokens for w in workloads)
    kwargs = {
        "model": str(args.checkpoint),
        "dtype": args.dtype,
        "max_model_len": args.max_model_len or longest,
        "max_num_seqs": max(max(w.sequences for w in workloads), 8),
        "skip_tokenizer_init": True,
        "seed": 0,
        # else vLLM's default: CUDA graphs on a GPU, the model compiled by torch.compile on a CPU
        "enforce_eager": args.enforce_eager,
    }
    if on_gpu:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_cudagraph_capture_size:
        kwargs["compilation_config"] = {
            "max_cudagraph_capture_size": args.max_cudagraph_capture_size
        }
    return kwargs


def run_workload(llm, workload: Workload, prompts) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True, temperature=0)
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    start = time.perf_counter()
    llm.generate(requests, params, use_tqdm=False)
    return time.perf_counter() - start


def profile_summary(profiler, on_gpu: bool, top: int) -> dict:
    """The ``top`` ops by self time (device time on a GPU) and the watched ops' calls."""
    events = profiler.key_averages()

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", 0.0) or 0.0)

    key = device_us if on_gpu else (lambda event: float(event.self_cpu_time_total))
    ranked = sorted(events, key=key, reverse=True)[:top]
    rows = [
        {
            "op": e.key,
            "calls": e.count,
            "self_cpu_us": float(e.self_cpu_time_total),
            "self_device_us": device_us(e),
        }
        for e in ranked
    ]
    watched = {}
    for event in events:
        for name in WATCHED_OPS:
            if name in event.key:
                entry = watched.setdefault(name, {"calls": 0, "cpu_us": 0.0, "device_us": 0.0})
                entry["calls"] += event.count
                entry["cpu_us"] += float(event.cpu_time_total)
                entry["device_us"] += float(getattr(event, "device_time_total", 0.0) or 0.0)
    for entry in watched.values():
        entry["cpu_us_per_call"] = entry["cpu_us"] / entry["calls"] if entry["calls"] else None
    return {"top": rows, "watched": watched}


def profiled(llm, workload: Workload, prompts, on_gpu: bool, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as profiler:
        run_workload(llm, workload, prompts)
        if on_gpu:
            torch.cuda.synchronize()
    return profile_summary(profiler, on_gpu, top)


def weight_bytes(llm, count) -> dict:
    """``count`` (``sparse_weight_bytes``) run on the engine's model, or why it could not."""
    try:
        return llm.apply_model(count)[0]
    except Exception as error:  # an older vLLM without apply_model on its engine
        return {"error": f"{type(error).__name__}: {error}", "ratio": None, "packed_layers": 0}


def resident_bytes(field: str = "VmRSS") -> int | None:
    """This process's resident memory (``VmHWM``: its peak), from /proc (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def graph_settings(llm) -> dict:
    """The step sizes the engine runs as CUDA graphs, its largest step (chunked-prefill steps
    above ``max_cudagraph_capture_size`` run without graphs) and its compilation mode
    (``NONE``: eager)."""
    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    return {
        "compilation_mode": compilation_mode(config),
        "max_cudagraph_capture_size": getattr(compilation, "max_cudagraph_capture_size", None),
        "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", None)),
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }


def start_engine(args) -> tuple:
    """The engine for ``args`` (its checkpoint, kernel mode and options), what it holds once
    loaded (``measure``'s result without its workloads), and the checkpoint's config."""
    os.environ[KERNEL_MODE_VARIABLE] = args.mode  # read as the plugin loads layers
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm

    from whisper_sparse.heap import release_freed_heap
    from whisper_sparse.weight_bytes import sparse_weight_bytes

    workloads = [Workload.parse(text) for text in args.workloads]
    on_gpu = torch.cuda.is_available()
    config = json.loads(Path(args.checkpoint, "config.json").read_text())
    kwargs = engine_arguments(args, workloads, on_gpu)
    start = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    result = {
        "label": args.label,
        "mode": args.mode,
        "engine": kwargs,
        "start_seconds": time.perf_counter() - start,
        "device": torch.cuda.get_device_name() if on_gpu else "CPU",
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "weights": weight_bytes(llm, sparse_weight_bytes),
        "graphs": graph_settings(llm),
        "workloads": {},
        "profiles": {},
        "rss_after_load": resident_bytes(),
    }
    # the same after this process's freed heap pages went back to the OS (every engine alike:
    # dense vLLM keeps its load's freed pages, the plugin returns its own)
    release_freed_heap()
    result["rss_after_load_trimmed"] = resident_bytes()
    if on_gpu:
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return llm, result, config


def measure(args) -> dict:
    """Start the engine, run every workload, and return the whole result."""
    import torch

    llm, result, config = start_engine(args)
    on_gpu = torch.cuda.is_available()
    for workload in (Workload.parse(text) for text in args.workloads):
        prompts = prompts_for(workload, config["vocab_size"])
        run_workload(llm, workload, prompts[:2])  # warm-up
        seconds = [run_workload(llm, workload, prompts) for _ in range(args.repeats)]
        result["workloads"][workload.name] = {
            "seconds": seconds,
            "tokens_per_s": workload.counted_tokens / statistics.median(seconds),
        }
        print(
            f"{args.label} {workload.name}: "
            f"{result['workloads'][workload.name]['tokens_per_s']:,.0f} tokens/s",
            flush=True,
        )
        if args.profile:
            result["profiles"][workload.name] = profiled(llm, workload, prompts, on_gpu, args.top)
    result["rss_peak"] = resident_bytes("VmHWM")
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--label", default=None, help="default: the checkpoint's name")
    parser.add_argument(
        "--mode",
        default="auto",
        choices=KERNEL_MODES,
        help=f"${KERNEL_MODE_VARIABLE} for the plugin's 2:4 layers",
    )
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        default=None,
        help="vLLM's compilation_config.max_cudagraph_capture_size",
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=12, help="ops kept per profile")
    parser.add_argument("--out", type=Path, default=None, help="JSON result (default: stdout)")
    args = parser.parse_args(argv)
    check_workloads(parser, args.workloads)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.label = args.label or args.checkpoint.name
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    text = json.dumps(result, indent=1, default=str)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
