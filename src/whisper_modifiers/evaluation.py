"""Perplexity with the protocol of Wanda/SparseGPT: non-overlapping windows, exp(mean NLL)."""

from __future__ import annotations

import math

import torch

__all__ = ["perplexity"]


@torch.no_grad()
def perplexity(
    model,
    token_ids: torch.Tensor | list[int],
    seq_len: int,
    max_windows: int | None = None,
    bos_token_id: int | None = None,
) -> float:
    """Perplexity of ``model`` on consecutive non-overlapping windows of ``seq_len``
    tokens (the incomplete tail is dropped): ``exp`` of the mean next-token negative
    log-likelihood over every predicted token.  With ``bos_token_id`` each window
    starts with BOS followed by ``seq_len - 1`` corpus tokens (Gemma needs it).
    """
    token_ids = torch.as_tensor(token_ids).reshape(-1)
    body = seq_len - (bos_token_id is not None)
    num_windows = token_ids.numel() // body
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    if num_windows == 0:
        raise ValueError(f"{token_ids.numel()} tokens make no window of {seq_len}")
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for w in range(num_windows):
        window = token_ids[w * body : (w + 1) * body]
        if bos_token_id is not None:
            window = torch.cat([torch.tensor([bos_token_id]), window])
        window = window.unsqueeze(0).to(device)
        logits = model(window).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:], reduction="sum")
        total_nll += nll.item()
        total_tokens += window.shape[1] - 1
    return math.exp(total_nll / total_tokens)
