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
"""

from __future__ import annotations

import json
import sys


def main(request_path: str) -> int:
    request = json.loads(open(request_path).read())
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
            nll = -sum(output.prompt_logprobs[i][token].logprob for i, token in
                       enumerate(ids) if i > 0)  # fmt: skip
            answer["scores"].append({"nll": nll, "tokens": len(ids) - 1})
    print("WHISPER_VLLM_RESULT " + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":  # also under `python -c`
    sys.exit(main(sys.argv[1]))
