"""Distributed calibration under torchrun: glue between llmcompressor's pipeline and the
modifiers; no statistic or solver maths here.

Each rank calibrates a contiguous shard of the calibration sequences (``shard_bounds``,
llmcompressor's partition formula); ``calibration_shard`` tells the modifiers where their
shard starts, so that the pairs of sequence ``i`` are seeded by its global index ``i``
whatever the number of ranks. The statistics are float64 sums over sequences
(``calibration_statistics``), so before solving a layer they are summed across ranks and
turned into the float32 means the solvers take (``CalibrationStatistics.reduce``):
the result is the one-process result, bit for bit. Each module is solved on one rank
(``solve_on_owners``, compressed-tensors' ``greedy_bin_packing`` by weight size) and its
pruned weight broadcast from there.

The ranks may share their weights: llmcompressor's sequential pipeline offloads the model
with compressed-tensors' ``DistributedCPUCache`` (``set_onload_device``), one copy of
every weight per node in shared memory, so a weight one rank writes is at once every
rank's. No rank writes a weight while another may still read the one it replaces
(``wait_for_every_rank``: before a layer's solve, and before the model check swaps
weights).
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

from whisper_modifiers.statistics import SUM_DTYPE

__all__ = [
    "all_reduce_sum",
    "calibration_shard",
    "finish",
    "init_from_torchrun",
    "is_distributed",
    "rank",
    "sequence_offset",
    "shard_bounds",
    "solve_on_owners",
    "sum_over_ranks",
    "wait_for_every_rank",
    "world_size",
]

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
        dist.init_process_group(
            backend="nccl" if device else "gloo",
            init_method="env://",
            timeout=COLLECTIVE_TIMEOUT,
            device_id=device,
        )
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
    return [
        (num_sequences * r // num_ranks, num_sequences * (r + 1) // num_ranks)
        for r in range(num_ranks)
    ]


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


def sum_over_ranks(total: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """A float64 sum over ranks (a rank that summed nothing adds zeros of ``shape``)."""
    if not is_distributed():
        return total
    local = torch.zeros(shape, dtype=SUM_DTYPE) if total is None else total.to(SUM_DTYPE)
    return _all_reduce(local.clone())


def all_reduce_sum(value: float | torch.Tensor) -> float | torch.Tensor:
    """``value`` (a number or a float64 tensor) summed over ranks (itself in one process)."""
    if not is_distributed():
        return value
    if isinstance(value, torch.Tensor):
        return _all_reduce(value.to(torch.float64).clone())
    return float(_all_reduce(torch.tensor([value], dtype=torch.float64)).item())


def wait_for_every_rank() -> None:
    """Return once every rank is here (at once in one process): before a rank writes
    weights that the ranks may share (module docstring)."""
    if is_distributed():
        dist.barrier()


# ---- solving on one rank -----------------------------------------------------------------


def solve_on_owners(statistics, modules: Iterable[torch.nn.Module], solve: Callable[[], None]):
    """Run ``solve`` (which prunes the modules left in ``statistics``, a
    ``CalibrationStatistics``) for the modules this rank owns, then broadcast every
    module's pruned weight from its owner. No rank writes before every rank is done
    reading the layer's weights (``wait_for_every_rank``; a deferred gamma choice solves
    from the dense weights). In one process, just ``solve()``."""
    modules = list(modules)
    if not is_distributed():
        solve()
        return
    _, _, owner = greedy_bin_packing(list(modules), world_size(), lambda m: m.weight.numel())
    here = rank()
    wait_for_every_rank()
    statistics.keep_only([module for module in statistics if owner.get(module, here) == here])
    solve()
    for module in modules:
        with torch.no_grad(), align_module_device(module):
            weight = module.weight.data
            travelling = weight.cuda() if dist.get_backend() == "nccl" else weight
            dist.broadcast(travelling, src=owner[module])
            pruned = travelling.to(weight.device)
        update_offload_parameter(module, "weight", pruned)
