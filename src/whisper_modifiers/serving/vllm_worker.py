"""Run a checkpoint in vLLM's offline engine and print the results as one JSON line.

This file runs in the *serving* environment (``scripts/setup_serving.sh``), which has vLLM
but not llmcompressor, so it imports nothing from this package: ``serving.run_vllm``
starts it as a script with the serving environment's Python.

    python -c "$(cat vllm_worker.py)" REQUEST.json

The request holds ``model``, ``dtype``, ``max_model_len``, ``prompts`` (lists of token
ids, completed greedily for ``max_tokens`` tokens) and ``score`` (lists of token ids whose
log-likelihood vLLM reports through ``prompt_logprobs``). The answer holds ``completions``
(generated token ids per prompt) and ``scores`` (per sequence: the summed negative
log-likelihood of every token after the first, and how many tokens that is).

A request with ``"probe_dtypes"`` instead asks which activation dtypes vLLM's kernels for
this checkpoint's quantization scheme accept on this machine. First, which of the
``required_ops`` this CPU's build of vLLM lacks (``missing_ops``: then nothing is tried);
then, for each candidate dtype
and each ``layers`` entry (``[name, out_features, in_features]``), the scheme vLLM would
pick for that layer creates random weights, processes them as after loading and runs one
forward; the answer's ``accepted`` lists the dtypes for which every layer ran and gave
finite outputs, and ``errors`` the first error of each refused dtype.
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
    accepted, errors = [], {}
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig()):
        # one process, as the engine sets it up: the layers look up their TP group
        init_distributed_environment(1, 0, f"file://{tmp}/init", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    for name in request["probe_dtypes"]:
        dtype = getattr(torch, name)
        try:  # the engine's config for this dtype (schemes read the model dtype from it)
            model_config = ModelConfig(model=request["model"], dtype=name, enforce_eager=True)
            with set_current_vllm_config(VllmConfig(model_config=model_config)):
                for layer_name, out_features, in_features in request["layers"]:
                    _probe_layer(config, layer_name, out_features, in_features, dtype)
        except Exception as error:  # the kernel refused this dtype (or this shape)
            errors[name] = f"{type(error).__name__}: {error}"[:500]
        else:
            accepted.append(name)
    return {"accepted": accepted, "errors": errors, "missing_ops": []}


def _probe_layer(config, layer_name: str, out_features: int, in_features: int, dtype) -> None:
    import torch

    # matched by class name as vLLM's RowParallelLinear etc. are: "Linear" is contained
    layer = type("ProbeLinear", (torch.nn.Module,), {})()
    scheme = config.get_scheme(layer, layer_name)
    if scheme is None:  # left unquantized: vLLM's dense path takes any dtype
        return
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


def main(request_path: str) -> int:
    request = json.loads(open(request_path).read())
    if "probe_dtypes" in request:
        print("WHISPER_VLLM_RESULT " + json.dumps(probe_dtypes(request)), flush=True)
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
    answer = {"completions": [], "scores": []}
    if request.get("prompts"):
        greedy = SamplingParams(temperature=0.0, max_tokens=request.get("max_tokens", 16))
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]],
                               greedy)  # fmt: skip
        answer["completions"] = [list(output.outputs[0].token_ids) for output in outputs]
    if request.get("score"):
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["score"]],
                               scoring)  # fmt: skip
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
