"""Distributed calibration under torchrun: glue between llmcompressor's pipeline and the
modifiers; no statistic or solver maths here.

Each rank calibrates a contiguous shard of the calibration sequences (``shard_bounds``,
llmcompressor's partition formula); ``calibration_shard`` tells the modifiers where their
shard starts, so that the pairs of sequence ``i`` are seeded by its global index ``i``
whatever the number of ranks. Before solving a layer, every statistic is reduced across
ranks (``reduce_statistics``: running means weighted by their counts, sums summed, in
float64), each module is solved on one rank (``solve_on_owners``, compressed-tensors'
``greedy_bin_packing`` by weight size) and its pruned weight broadcast from there.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from compressed_tensors.distributed import greedy_bin_packing
from compressed_tensors.utils import align_module_device, update_offload_parameter
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier

__all__ = [
    "DistributedSparseGPTModifier",
    "DistributedWandaModifier",
    "MEAN_STATISTICS",
    "SUM_STATISTICS",
    "all_reduce_sum",
    "calibration_shard",
    "distributed_baseline",
    "finish",
    "init_from_torchrun",
    "is_distributed",
    "rank",
    "reduce_statistics",
    "sequence_offset",
    "shard_bounds",
    "solve_on_owners",
    "world_size",
]

MEAN_STATISTICS = (
    ("_row_scalars", "_num_samples"),  # Wanda's ||X_j||^2 (Wisp's ||dX_j||^2)
    ("_hessians", "_num_samples"),  # SparseGPT's H
    ("_difference_hessians", "_difference_samples"),  # Whisper's H_Delta
    ("_plain_norms", "_plain_counts"),  # gamma-regularised Wisp / Wisp+'s ||X_j||^2
)
"""``(statistic dict, count dict)`` attributes of modifiers that keep running means over
sequences; a count dict is reduced once, after every statistic that uses it."""

SUM_STATISTICS = ("_neuronwise_sums", "_difficulty_sums")  # Wisp+, counted by:
SUM_COUNTS = "_neuronwise_counts"
CENTERING = "_centering"  # module -> (running mean of s x_bar x_bar^T, count)

_offset = 0


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


COLLECTIVE_TIMEOUT = datetime.timedelta(hours=3)
"""How long a rank waits for the others (rank 0 evaluates the dense model alone while
they wait; NCCL's default, 10 minutes, is too short for a large model)."""


def init_from_torchrun() -> bool:
    """Join torchrun's process group when started by torchrun with more than one
    process (NCCL on this process's GPU, ``LOCAL_RANK``, as compressed-tensors' ``init_dist``
    does, else gloo), with ``COLLECTIVE_TIMEOUT``; False otherwise."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    if not dist.is_initialized():
        device = None
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device else "gloo", init_method="env://",
                                timeout=COLLECTIVE_TIMEOUT, device_id=device)  # fmt: skip
    return True


def finish() -> None:
    """Leave the process group once calibration is done (after a barrier), so that rank 0
    evaluates and saves on its own: llmcompressor's ``save_pretrained`` holds barriers
    that the other ranks would never reach."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def shard_bounds(num_sequences: int, num_ranks: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` per rank: llmcompressor's ``get_rank_partition``
    formula (``floor(n * r / N)``)."""
    return [(num_sequences * r // num_ranks, num_sequences * (r + 1) // num_ranks)
            for r in range(num_ranks)]  # fmt: skip


@contextlib.contextmanager
def calibration_shard(offset: int):
    """Within it, this rank's calibration sequences start at global index ``offset``."""
    global _offset
    previous, _offset = _offset, offset
    try:
        yield
    finally:
        _offset = previous


def sequence_offset() -> int:
    """The global index of this rank's first calibration sequence."""
    return _offset


# ---- reductions --------------------------------------------------------------------------


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum across ranks (a CPU tensor travels through the GPU when the group is NCCL)."""
    device = tensor.device
    if dist.get_backend() == "nccl" and device.type == "cpu":
        tensor = tensor.cuda()
    dist.all_reduce(tensor)
    return tensor.to(device)


def _reduce_mean(mean: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """The mean over all ranks' samples of per-rank running means, in float64."""
    total = int(_all_reduce(torch.tensor([count], dtype=torch.float64)).item())
    weighted = _all_reduce(mean.to(torch.float64) * count)
    return (weighted / max(total, 1)).to(mean.dtype), total


def all_reduce_sum(value: float | torch.Tensor) -> float | torch.Tensor:
    """``value`` (a number or a float64 tensor) summed over ranks (itself in one process)."""
    if not is_distributed():
        return value
    if isinstance(value, torch.Tensor):
        return _all_reduce(value.to(torch.float64).clone())
    return float(_all_reduce(torch.tensor([value], dtype=torch.float64)).item())


def reduce_statistics(modifier) -> None:
    """Replace every per-module statistic of ``modifier`` by its reduction over ranks
    (a no-op in one process). Modules are visited in registration order, which every
    rank shares."""
    if not is_distributed():
        return
    order = list(modifier._module_names)
    for statistic_name, count_name in MEAN_STATISTICS:
        statistics = getattr(modifier, statistic_name, None)
        counts = getattr(modifier, count_name, None)
        if statistics is None or counts is None:
            continue
        for module in [m for m in order if m in statistics]:
            statistics[module], total = _reduce_mean(statistics[module], counts[module])
            counts[module] = total
    centering = getattr(modifier, CENTERING, None) or {}
    for module in [m for m in order if m in centering]:
        centering[module] = _reduce_mean(*centering[module])
    counts = getattr(modifier, SUM_COUNTS, None) or {}
    for module in [m for m in order if m in counts]:
        for name in SUM_STATISTICS:
            sums = getattr(modifier, name)
            if not _any_rank(module in sums):
                continue
            local = sums.get(module)
            if local is None:  # this rank's sequences added nothing
                local = torch.zeros(_sum_shape(name, module), dtype=torch.float32)
            sums[module] = _all_reduce(local)
        counts[module] = int(_all_reduce(torch.tensor([counts[module]])).item())


def _sum_shape(name: str, module: torch.nn.Module) -> tuple[int, ...]:
    return tuple(module.weight.shape) if name == SUM_STATISTICS[0] else (module.weight.shape[0],)


def _any_rank(flag: bool) -> bool:
    return bool(_all_reduce(torch.tensor([int(flag)])).item())


# ---- solving on one rank -----------------------------------------------------------------


def solve_on_owners(modifier, modules: Iterable[torch.nn.Module], solve: Callable[[], None]):
    """Run ``solve`` (which prunes the modules left in ``modifier``'s statistic dicts,
    ``statistic_names``) for the modules this rank owns, then broadcast every module's
    pruned weight from its owner. In one process, just ``solve()``."""
    modules = list(modules)
    if not is_distributed():
        solve()
        return
    _, _, owner = greedy_bin_packing(list(modules), world_size(), lambda m: m.weight.numel())
    here = rank()
    for name in statistic_names():
        held = getattr(modifier, name, None)
        if held is None:
            continue
        for module in modules:
            if owner[module] != here:
                held.pop(module, None)
    solve()
    for module in modules:
        with torch.no_grad(), align_module_device(module):
            weight = module.weight.data
            travelling = weight.cuda() if dist.get_backend() == "nccl" else weight
            dist.broadcast(travelling, src=owner[module])
            pruned = travelling.to(weight.device)
        update_offload_parameter(module, "weight", pruned)


def statistic_names() -> tuple[str, ...]:
    """Every per-module dict ``solve_on_owners`` may need to thin out."""
    means = tuple(name for pair in MEAN_STATISTICS for name in pair)
    return (*means, *SUM_STATISTICS, SUM_COUNTS, CENTERING)


# ---- the stock baselines -----------------------------------------------------------------


class _OwnerSolving:
    """``compress_modules`` of a stock modifier, with statistics reduced across ranks and
    each module solved on one rank."""

    def compress_modules(self):
        reduce_statistics(self)
        modules = [m for m in self._module_names if m in self._num_samples]
        solve_on_owners(self, modules, super().compress_modules)


class DistributedWandaModifier(_OwnerSolving, WandaPruningModifier):
    """llmcompressor's ``WandaPruningModifier`` whose statistics reduce under torchrun."""


class DistributedSparseGPTModifier(_OwnerSolving, SparseGPTModifier):
    """llmcompressor's ``SparseGPTModifier`` whose Hessians reduce under torchrun."""


def distributed_baseline(modifier):
    """llmcompressor's own Wanda or SparseGPT modifier (exactly those classes) as the
    distributed one with the same fields; any other modifier unchanged."""
    classes = {
        WandaPruningModifier: DistributedWandaModifier,
        SparseGPTModifier: DistributedSparseGPTModifier,
    }
    cls = classes.get(type(modifier))
    return modifier if cls is None else cls(**modifier.model_dump(exclude_unset=True))
