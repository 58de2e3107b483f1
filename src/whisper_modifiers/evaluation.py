"""Evaluation: WikiText-2 perplexity (Wanda/SparseGPT protocol) and lm-eval tasks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

__all__ = [
    "PAPER_TASKS",
    "downstream",
    "evaluation_text",
    "evaluation_windows",
    "leading_token_ids",
    "perplexity",
    "wikitext2_test_text",
    "window_body",
]

# The paper's suite (Open LLM Leaderboard v1-like): task -> number of few-shot examples.
PAPER_TASKS = {
    "arc_challenge": 25,
    "mathqa": 0,
    "hellaswag": 10,
    "mmlu": 5,
    "truthfulqa_mc2": 0,
    "winogrande": 5,
}


def wikitext2_test_text(rows_json: str | Path | None = None) -> str:
    """WikiText-2 raw test text, ``"\\n\\n".join(rows)`` as Wanda/SparseGPT evaluate it.

    :param rows_json: a local JSON list of the split's rows (e.g.
        ``shared/data/wikitext-2-raw-v1/test_rows.json``); ``None`` reads the hub dataset.
    """
    if rows_json is not None:
        rows = json.loads(Path(rows_json).read_text(encoding="utf-8"))
    else:
        from datasets import load_dataset

        rows = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    return "\n\n".join(rows)


def evaluation_text(source: str) -> str:
    """Held-out text: ``"wikitext2"`` (hub test split), a WikiText-2 rows JSON file, or
    any ``data.load_corpus`` source (its test part)."""
    from whisper_modifiers.data import load_corpus

    if source == "wikitext2":
        return wikitext2_test_text()
    if str(source).endswith(".json"):
        return wikitext2_test_text(source)
    return load_corpus(source, split="test")


def leading_token_ids(tokenizer, text: str, count: int | None) -> list[int]:
    """The first ``count`` ids of ``tokenizer(text, add_special_tokens=False)`` (all of
    them where ``count`` is None), from as little of ``text`` as gives them: the first
    windows of a long evaluation text (``--eval-windows``, 16 by default, of a C4 shard of
    20,000 documents) need not wait for the whole text's tokens.

    A prefix is cut at the first blank line (else line end) after
    ``PREFIX_CHARS_PER_TOKEN`` characters a token asked for (twice as many again while it
    gives too few ids). A tokenizer splits text into pieces that a cut far after them
    leaves alone, so the prefix's first ids are the whole text's; they are taken once a
    prefix gives ``count + PREFIX_MARGIN_TOKENS`` ids and one a quarter longer gives the
    same first ``count``. Failing that (a short text), the whole text's."""
    if count is None:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    chars, previous = max(1, count) * PREFIX_CHARS_PER_TOKEN, None
    while True:
        cut = text.find("\n\n", chars)
        cut = cut if cut >= 0 else text.find("\n", chars)
        if cut < 0:
            return tokenizer(text, add_special_tokens=False)["input_ids"][:count]
        ids = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
        if previous is not None and ids[:count] == previous:
            return previous
        enough = len(ids) >= count + PREFIX_MARGIN_TOKENS
        previous = ids[:count] if enough else None
        chars = cut + cut // 4 if enough else 2 * cut


PREFIX_CHARS_PER_TOKEN = 6
"""``leading_token_ids``' first prefix: characters per token asked for (English text runs
about four characters a token)."""
PREFIX_MARGIN_TOKENS = 64
"""Ids a prefix must give beyond those asked for before its first ids are checked."""


def window_body(seq_len: int, bos_token_id: int | None = None) -> int:
    """Corpus tokens in one evaluation window of ``seq_len``: all of them, or all but the
    BOS that starts it."""
    return seq_len - (bos_token_id is not None)


def evaluation_windows(
    token_ids: torch.Tensor | list[int],
    seq_len: int,
    max_windows: int | None = None,
    bos_token_id: int | None = None,
) -> list[torch.Tensor]:
    """Consecutive non-overlapping windows of ``seq_len`` tokens (the incomplete tail is
    dropped), each starting with ``bos_token_id`` when given; only the first
    ``max_windows`` when given."""
    token_ids = torch.as_tensor(token_ids).reshape(-1)
    body = window_body(seq_len, bos_token_id)
    num_windows = token_ids.numel() // body
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    if num_windows == 0:
        raise ValueError(f"{token_ids.numel()} tokens make no window of {seq_len}")
    windows = [token_ids[w * body : (w + 1) * body] for w in range(num_windows)]
    if bos_token_id is not None:
        windows = [torch.cat([torch.tensor([bos_token_id]), window]) for window in windows]
    return windows


@torch.no_grad()
def perplexity(
    model,
    token_ids: torch.Tensor | list[int],
    seq_len: int,
    max_windows: int | None = None,
    bos_token_id: int | None = None,
    progress: bool = False,
) -> float:
    """Perplexity of ``model`` on consecutive non-overlapping windows of ``seq_len``
    tokens (the incomplete tail is dropped): ``exp`` of the mean next-token negative
    log-likelihood over every predicted token.  With ``bos_token_id`` each window
    starts with BOS followed by ``seq_len - 1`` corpus tokens (Gemma needs it).
    ``max_windows`` evaluates only the first windows.
    """
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    windows = evaluation_windows(token_ids, seq_len, max_windows, bos_token_id)
    for window in tqdm(windows, desc="perplexity", disable=not progress):
        window = window.unsqueeze(0).to(device)
        logits = model(window).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:], reduction="sum")
        total_nll += nll.item()
        total_tokens += window.shape[1] - 1
    return math.exp(total_nll / total_tokens)


def downstream(
    model,
    tokenizer,
    tasks: dict[str, int] | None = None,
    limit: int | float | None = None,
    include_path: str | Path | None = None,
    batch_size: int = 1,
) -> dict[str, dict[str, float]]:
    """Zero/few-shot accuracy with lm-evaluation-harness (``lm_eval``).

    :param tasks: task name -> few-shot count; default the paper's suite
        (``PAPER_TASKS``; the datasets come from the Hugging Face hub).
    :param limit: examples per task (``lm_eval``'s ``limit``), for quick runs.
    :param include_path: a folder of extra task YAML files (e.g. local tasks).
    :return: task -> metric -> value (lm_eval's ``results`` with the ``,none`` filter
        suffix removed).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = dict(PAPER_TASKS if tasks is None else tasks)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    results = {}
    for shots in sorted(set(tasks.values())):  # lm_eval takes one few-shot count per call
        names = [task for task, n in tasks.items() if n == shots]
        out = simple_evaluate(
            model=lm, tasks=names, num_fewshot=shots, limit=limit, task_manager=manager
        )
        for task, metrics in out["results"].items():
            results[task] = {
                key.split(",")[0]: value
                for key, value in metrics.items()
                if isinstance(value, (int, float)) and not key.startswith("alias")
            }
    return results
