"""Distributed calibration under torchrun: glue between llmcompressor's pipeline and the
modifiers; no statistic or solver maths here.

Each rank calibrates a contiguous shard of the calibration sequences (``shard_bounds``,
llmcompressor's partition formula); ``calibration_shard`` tells the modifiers where their
shard starts, so that the pairs of sequence ``i`` are seeded by its global index ``i``
whatever the number of ranks. The statistics are float64 sums over sequences
(``sequence_sums.SequenceSumCalibration``), so before solving a layer they are summed
across ranks and turned into the float32 means the solvers take (``reduce_statistics``):
the result is the one-process result, bit for bit. Each module is solved on one rank
(``solve_on_owners``, compressed-tensors' ``greedy_bin_packing`` by weight size) and its
pruned weight broadcast from there.
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

from whisper_modifiers.statistics import STATISTICS_DTYPE, SUM_DTYPE, mean_over_sequences

__all__ = [
    "SEQUENCE_SUMS",
    "SUM_STATISTICS",
    "all_reduce_sum",
    "calibration_shard",
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

SEQUENCE_SUMS = (
    ("_row_scalars", "_num_samples", 1.0),  # Wanda's ||X_j||^2 (Wisp's ||dX_j||^2)
    ("_hessians", "_num_samples", 2.0),  # SparseGPT's H = (2 / N) X X^T
    ("_difference_hessians", "_difference_samples", 2.0),  # Whisper's H_Delta
    ("_plain_norms", "_plain_counts", 1.0),  # gamma-regularised Wisp / Wisp+'s ||X_j||^2
)
"""``(statistic dict, count dict, scale)`` attributes of modifiers that sum a statistic
over sequences in float64; the solvers take ``scale * sum / count`` in float32. A count
dict is reduced once, after every statistic that uses it."""

SUM_STATISTICS = ("_neuronwise_sums", "_difficulty_sums")  # Wisp+, counted by:
SUM_COUNTS = "_neuronwise_counts"
CENTERING = "_centering"  # module -> (float64 sum of s x_bar x_bar^T, count)

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


def _sum_over_ranks(total: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """A float64 sum over ranks (a rank that summed nothing adds zeros of ``shape``)."""
    if not is_distributed():
        return total
    local = torch.zeros(shape, dtype=SUM_DTYPE) if total is None else total.to(SUM_DTYPE)
    return _all_reduce(local.clone())


def _count_over_ranks(count: int) -> int:
    if not is_distributed():
        return count
    return int(_all_reduce(torch.tensor([count], dtype=torch.float64)).item())


def all_reduce_sum(value: float | torch.Tensor) -> float | torch.Tensor:
    """``value`` (a number or a float64 tensor) summed over ranks (itself in one process)."""
    if not is_distributed():
        return value
    if isinstance(value, torch.Tensor):
        return _all_reduce(value.to(torch.float64).clone())
    return float(_all_reduce(torch.tensor([value], dtype=torch.float64)).item())


def reduce_statistics(modifier) -> None:
    """Sum every per-module statistic of ``modifier`` over ranks (float64; nothing to sum
    in one process) and replace it by what the solvers take: ``scale * sum / count`` in
    float32 for ``SEQUENCE_SUMS`` and the centering terms, the float32 sum for Wisp+'s
    ``SUM_STATISTICS``. Call it once per set of statistics, before solving. Modules are
    visited in registration order, which every rank shares."""
    order = list(modifier._module_names)
    totals = {}
    for statistic_name, count_name, scale in SEQUENCE_SUMS:
        statistics = getattr(modifier, statistic_name, None)
        counts = getattr(modifier, count_name, None)
        if statistics is None or counts is None:
            continue
        reduced = totals.setdefault(count_name, {})
        for module in [m for m in order if _any_rank(m in statistics)]:
            count = reduced.setdefault(module, _count_over_ranks(counts.get(module, 0)))
            shape = _statistic_shape(statistic_name, module)
            total = _sum_over_ranks(statistics.get(module), shape)
            statistics[module] = mean_over_sequences(total, count, scale)
    for count_name, reduced in totals.items():
        getattr(modifier, count_name).update(reduced)
    centering = getattr(modifier, CENTERING, None) or {}
    for module in [m for m in order if m in centering]:
        total, count = centering[module]
        count = _count_over_ranks(count)
        total = _sum_over_ranks(total, tuple(total.shape))
        centering[module] = (mean_over_sequences(total, count, 2.0 if total.dim() == 2 else 1.0),
                             count)  # fmt: skip
    counts = getattr(modifier, SUM_COUNTS, None) or {}
    for module in [m for m in order if m in counts]:
        for name in SUM_STATISTICS:
            sums = getattr(modifier, name)
            if not _any_rank(module in sums):
                continue
            total = _sum_over_ranks(sums.get(module), _sum_shape(name, module))
            sums[module] = total.to(STATISTICS_DTYPE)
        counts[module] = _count_over_ranks(counts[module])


def _statistic_shape(name: str, module: torch.nn.Module) -> tuple[int, ...]:
    columns = module.weight.shape[1]
    return (columns, columns) if "hessian" in name else (columns,)


def _sum_shape(name: str, module: torch.nn.Module) -> tuple[int, ...]:
    return tuple(module.weight.shape) if name == SUM_STATISTICS[0] else (module.weight.shape[0],)


def _any_rank(flag: bool) -> bool:
    if not is_distributed():
        return flag
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
    sums = tuple(name for statistic, count, _ in SEQUENCE_SUMS for name in (statistic, count))
    return (*sums, *SUM_STATISTICS, SUM_COUNTS, CENTERING)
