"""Causal attention during calibration, where llmcompressor 0.14's sequential pipeline
loses the mask.

The sequential pipeline forces eager attention for its traced graphs by patching the
model's config. For some families (Qwen3-MoE, Mixtral under transformers 5.17) the
traced graph builds a fresh copy of the config for ``create_causal_mask``, which then
takes the default SDPA path and returns ``None`` for an unpadded batch ("SDPA is causal by
itself"); the layers' eager attention, given no mask, attends to every token, future ones
included. ``watch_causal_masks`` gives such an attention module the causal mask it
should have had: with ``None`` returned only for unpadded batches, that mask is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from loguru import logger

__all__ = ["watch_causal_masks"]


def watch_causal_masks(model: torch.nn.Module, register_hook: Callable) -> None:
    """Pre-hook every causal self-attention module of ``model`` (``is_causal`` and a
    ``config``) with ``register_hook`` (the modifier's), to add the causal mask to an
    eager call that received none."""
    warned = []

    def add_causal_mask(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if (
            len(args) > 1  # a positional mask: left as it is
            or kwargs.get("attention_mask") is not None
            or getattr(module.config, "_attn_implementation", None) != "eager"
            or not torch.is_tensor(hidden)
            or hidden.dim() != 3
            or hidden.shape[1] < 2
        ):
            return None
        if not warned:
            warned.append(True)
            logger.warning(
                f"{type(module).__name__} was called with eager attention and no mask "
                "(llmcompressor's sequential pipeline traced a copy of the config that "
                "lost its eager attention); calibrating with the causal mask instead"
            )
        length = hidden.shape[1]
        mask = torch.full(
            (length, length),
            torch.finfo(hidden.dtype).min,
            dtype=hidden.dtype,
            device=hidden.device,
        ).triu(1)
        return args, {**kwargs, "attention_mask": mask[None, None]}

    for _, module in model.named_modules():
        if getattr(module, "is_causal", False) is True and hasattr(module, "config"):
            register_hook(module, add_causal_mask, "forward_pre", with_kwargs=True)
