"""Sets of a modifier's per-module statistics (``distributed.statistic_names``: dicts of
float64 sums, counts and centering terms), for ``gamma: auto``'s folds: copies, the
statistics less a fold's, and swapping them in and out. Glue; no maths here."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["copy_statistics", "restored_statistics", "statistics_without"]


@contextlib.contextmanager
def restored_statistics(modifier, names: list[str]):
    """Within it, ``modifier``'s statistic dicts ``names`` may be replaced by other sets;
    the ones it held are put back on exit."""
    held = {name: getattr(modifier, name) for name in names}
    try:
        yield
    finally:
        for name, statistics in held.items():
            setattr(modifier, name, statistics)


def copy_statistics(statistics: dict, modules: set) -> dict:
    """A copy of the entries of ``modules`` in a per-module statistic dict, sharing no
    tensor with it."""
    return {module: _add(None, value) for module, value in statistics.items() if module in modules}


def statistics_without(everything: dict, part: dict, name: str) -> dict:
    """``{module: sum}`` of statistic ``name`` in ``everything`` less its sum in ``part``
    (both ``{name: {module: value}}``), in new tensors: the statistics of every sequence
    outside ``part``."""
    return {module: _add(value, part[name].get(module), sign=-1)
            for module, value in everything[name].items()}  # fmt: skip


def _add(total, value, sign: int = 1):
    """``total + sign * value`` for a statistic's value: a float64 sum, a count, or a
    tuple of them (centering); a copy of the other when either is None."""
    if value is None or total is None:
        kept = total if value is None else value
        if isinstance(kept, tuple):
            return tuple(_add(None, v) for v in kept)
        return kept.clone() if isinstance(kept, torch.Tensor) else kept
    if isinstance(value, tuple):
        return tuple(_add(t, v, sign) for t, v in zip(total, value, strict=True))
    if isinstance(value, torch.Tensor):
        return total + sign * value.to(total.device)
    return total + sign * value
