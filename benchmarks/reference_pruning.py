"""The reference procedure of issue 50: Wanda and SparseGPT the way their authors' repositories
run them (``locuslab/wanda``, ``IST-DASLab/sparsegpt``), written here, so that every GPU speed
table carries its own anchor measured beside our methods on the same model.

    seconds = reference_prune(model, sequences, "sparsegpt", prune_n=2, prune_m=4)

Layer by layer, everything on ``device``:

1. the first decoder layer's inputs of every calibration sequence are caught once (the
   repositories' ``Catcher``: a hook that stops the forward there);
2. hooks on the layer's Linear modules gather float32 statistics over one forward per
   sequence: Wanda's running mean of ``||X_j||^2`` (its ``scaler_row``), SparseGPT's
   Hessian ``2 / n sum X X^T`` (its ``add_batch``);
3. each Linear is pruned: Wanda's ``|W_ij| sqrt(scaler_j)`` with every group of ``prune_m``
   columns chosen by one ``topk``; SparseGPT's blocked OBS solve (``fasterprune``: blocks of
   128 columns, 1 % dampening, the N:M choice at the start of each group);
4. one forward per sequence again feeds the next layer.

Only torch and the model's own layers: no llmcompressor, no package code.
"""

from __future__ import annotations

import time

import torch

__all__ = ["REFERENCE_METHODS", "obs_prune", "reference_prune", "wanda_prune"]

REFERENCE_METHODS = ("wanda", "sparsegpt")


class _Caught(Exception):
    """Raised by the hook that catches the first layer's inputs."""


def _first_layer_inputs(model, sequences, device) -> tuple[list[torch.Tensor], dict]:
    """The first decoder layer's hidden states per sequence, and the keyword arguments the
    model passed it (rotary embeddings, mask: the same for every sequence of one length)."""
    layers, inputs, kwargs = model.model.layers, [], {}

    def catch(module, args, given):
        inputs.append(args[0] if args else given["hidden_states"])
        kwargs.update({k: v for k, v in given.items() if k != "hidden_states"})
        raise _Caught

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for ids in sequences:
            try:
                model(ids.reshape(1, -1).to(device), use_cache=False)
            except _Caught:
                pass
    finally:
        handle.remove()
    return inputs, kwargs


class _Statistics:
    """One Linear's statistic over the calibration forwards, as the repositories keep it."""

    def __init__(self, module: torch.nn.Linear, method: str):
        columns = module.weight.shape[1]
        device = module.weight.device
        self.method, self.samples = method, 0
        shape = (columns,) if method == "wanda" else (columns, columns)
        self.value = torch.zeros(shape, dtype=torch.float32, device=device)

    def add(self, module, args, output) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).t().float()  # [columns, tokens]
        batch = 1  # one sequence per forward
        self.value *= self.samples / (self.samples + batch)
        self.samples += batch
        if self.method == "wanda":
            self.value += torch.linalg.vector_norm(x, dim=1) ** 2 / self.samples
        else:
            x = (2 / self.samples) ** 0.5 * x
            self.value += x @ x.t()


def wanda_prune(
    weight: torch.Tensor, scaler: torch.Tensor, sparsity: float, prune_n: int, prune_m: int
) -> torch.Tensor:
    """Wanda's mask on ``|W| sqrt(scaler)``: per group of ``prune_m`` columns the ``prune_n``
    lowest (one ``topk`` over all groups), or per row the ``sparsity`` lowest."""
    metric = weight.float().abs() * scaler.sqrt().reshape(1, -1)
    rows, columns = metric.shape
    mask = torch.zeros_like(metric, dtype=torch.bool)
    if prune_n:
        groups = metric.reshape(rows, columns // prune_m, prune_m)
        lowest = groups.topk(prune_n, dim=-1, largest=False).indices
        mask.view(rows, columns // prune_m, prune_m).scatter_(-1, lowest, True)
    else:
        lowest = metric.sort(dim=-1, stable=True).indices[:, : int(columns * sparsity)]
        mask.scatter_(1, lowest, True)
    return weight.masked_fill(mask, 0)


def obs_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float,
    prune_n: int,
    prune_m: int,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> torch.Tensor:
    """SparseGPT's blocked OBS solve: columns in blocks of ``blocksize``, each column pruned
    by the mask chosen at the start of its group (N:M) or of its block (unstructured), the
    error spread over the later columns through the Cholesky factor of ``H^-1``."""
    W = weight.float().clone()
    H = hessian.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(H.shape[0], device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    columns = W.shape[1]
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Q1, Err1 = torch.zeros_like(W1), torch.zeros_like(W1)
        diagonal = torch.diag(Hinv1).reshape(1, -1)
        if prune_n:
            mask1 = torch.zeros_like(W1, dtype=torch.bool)
        else:
            scores = W1**2 / diagonal**2
            threshold = torch.sort(scores.flatten())[0][int(scores.numel() * sparsity)]
            mask1 = scores <= threshold
        for i in range(i2 - i1):
            w, d = W1[:, i], Hinv1[i, i]
            if prune_n and i % prune_m == 0:
                scores = W1[:, i : i + prune_m] ** 2 / diagonal[:, i : i + prune_m] ** 2
                mask1.scatter_(1, i + scores.topk(prune_n, dim=1, largest=False)[1], True)
            q = w.masked_fill(mask1[:, i], 0)
            Q1[:, i] = q
            err = (w - q) / d
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return W.to(weight.dtype)


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reference_prune(
    model,
    sequences,
    method: str,
    sparsity: float = 0.5,
    prune_n: int = 2,
    prune_m: int = 4,
    device=None,
) -> list[float]:
    """Prune ``model`` (a decoder with ``model.model.layers``, on ``device``) in place with
    the reference ``method`` on ``sequences`` (token-id tensors, one forward each); the
    wall seconds of each layer (statistics, solve, and the forwards that feed the next)."""
    if method not in REFERENCE_METHODS:
        raise ValueError(f"method must be one of {', '.join(REFERENCE_METHODS)}; got {method!r}")
    device = device or next(model.parameters()).device
    seconds = []
    with torch.no_grad():
        inputs, kwargs = _first_layer_inputs(model, sequences, device)
        for layer in model.model.layers:
            _synchronize(device)
            start = time.perf_counter()
            linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
            held = {name: _Statistics(module, method) for name, module in linears.items()}
            hooks = [
                module.register_forward_hook(held[name].add) for name, module in linears.items()
            ]
            for x in inputs:
                layer(x, **kwargs)
            for hook in hooks:
                hook.remove()
            for name, module in linears.items():
                value = held.pop(name).value
                if method == "wanda":
                    pruned = wanda_prune(module.weight, value, sparsity, prune_n, prune_m)
                else:
                    pruned = obs_prune(module.weight, value, sparsity, prune_n, prune_m)
                module.weight.copy_(pruned)
            inputs = [layer(x, **kwargs) for x in inputs]
            inputs = [x[0] if isinstance(x, tuple) else x for x in inputs]
            _synchronize(device)
            seconds.append(time.perf_counter() - start)
    return seconds
