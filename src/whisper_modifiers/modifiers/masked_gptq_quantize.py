"""GPTQ that keeps a pruning mask: the quantization half of SparseGPT's joint
sparsify-and-quantize (Frantar & Alistarh 2023, Section 3.5), with the mask fixed.

GPTQ (Frantar et al. 2023, Algorithm 1) quantizes the columns of ``W`` left to right and
spreads each column's error over the columns not yet quantized,

    q_i = quant(w_i),   e_i = (w_i - q_i) / [H^-1]_ii,   W[:, i:] -= e_i [H^-1]_{i, i:},

which also moves the pruned weights of later columns away from zero: stock GPTQ after a
2:4 pruner refills some of them (llmcompressor removed its mask in 2026). Here a pruned
weight's quantized value is zero,

    q_i = keep_i * quant(w_i),

so its whole accumulated update becomes part of ``e_i`` and is compensated by the
columns to its right, exactly as SparseGPT does for the weights it prunes; the OBS
update only ever changes weights that are kept. ``keep`` is ``W != 0`` on entry, the
pattern the pruning modifier left.
"""

from __future__ import annotations

from copy import copy

import torch
from compressed_tensors.quantization import (
    ActivationOrdering,
    QuantizationArgs,
    QuantizationStrategy,
    fake_quantize,
)
from llmcompressor.modifiers.gptq.helpers import (
    GPTQ_PRECISION,
    apply_activation_ordering,
    column_scale_window,
    factorize_hessian,
)

__all__ = ["masked_quantize_weight"]


def masked_quantize_weight(
    weights: torch.Tensor,
    hessians: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    global_scale: torch.Tensor | None,
    quant_args: QuantizationArgs,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llmcompressor's ``gptq_quantize.quantize_weight`` (same arguments and results:
    weights ``[batch, rows, columns]``, Hessians ``[batch, columns, columns]``) with every
    weight that is zero on entry kept at exactly zero.

    One function on purpose: it is ``quantize_weight``'s loop line for line, with the mask
    applied where the OBS update is made, so that the two can be compared directly."""
    batch_size, num_rows, num_columns = weights.shape
    final_dtype = weights.dtype
    device = weights.device
    W = weights.to(device=device, dtype=GPTQ_PRECISION)
    H = hessians.to(device=device, dtype=GPTQ_PRECISION)
    W, H, perm = apply_activation_ordering(W, H, quant_args.actorder)
    keep = W != 0  # the pruning mask, in the (possibly permuted) column order

    g_idx = None
    strategy = quant_args.strategy
    if strategy in (
        QuantizationStrategy.GROUP,
        QuantizationStrategy.TENSOR_GROUP,
        QuantizationStrategy.BLOCK,
    ):
        divisor = (
            quant_args.group_size
            if strategy != QuantizationStrategy.BLOCK
            else quant_args.block_structure[1]
        )
        g_idx = torch.arange(num_columns, device=device, dtype=torch.int) // divisor
        if quant_args.actorder == ActivationOrdering.WEIGHT:
            g_idx = torch.gather(g_idx.unsqueeze(0).expand(batch_size, -1), 1, perm)
    per_column = copy(quant_args)
    per_column.strategy = QuantizationStrategy.CHANNEL  # the window gives each column its own

    losses = torch.zeros(batch_size, num_rows, device=device)
    used_rtn_fallback = torch.zeros(batch_size, dtype=torch.bool, device=device)
    Hinv = factorize_hessian(W, H, percdamp, used_rtn_fallback)  # upper Cholesky of H^-1
    for i1 in range(0, num_columns, blocksize):
        i2 = min(i1 + blocksize, num_columns)
        W1 = W[:, :, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[:, i1:i2, i1:i2]
        column_scale, column_zero = column_scale_window(
            scale.to(device),
            None if zero_point is None else zero_point.to(device),
            None if global_scale is None else global_scale.to(device),
            g_idx,
            quant_args,
            num_rows=num_rows,
            i1=i1,
            i2=i2,
        )
        for i in range(i2 - i1):
            w = W1[:, :, i]
            q = fake_quantize(
                w.transpose(0, 1),
                column_scale[:, :, i].transpose(0, 1),
                None if column_zero is None else column_zero[:, :, i].transpose(0, 1),
                per_column,
            ).transpose(0, 1)
            q = torch.where(keep[:, :, i1 + i], q, torch.zeros_like(q))
            error = (w - q) / Hinv1[:, i, i][:, None]
            Q1[:, :, i] = q
            Err1[:, :, i] = error
            losses += error.square() / 2
            W1[:, :, i:] -= error.unsqueeze(-1) * Hinv1[:, i, i:].unsqueeze(1)
        W[:, :, i1:i2] = Q1
        W[:, :, i2:] -= torch.bmm(Err1, Hinv[:, i1:i2, i2:])

    if perm is not None:
        inverse = torch.argsort(perm, dim=-1)
        W = torch.gather(W, -1, inverse.unsqueeze(-2).expand(-1, num_rows, -1))
    return W.to(final_dtype), losses.sum(dim=1), used_rtn_fallback
