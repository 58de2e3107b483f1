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
    return {module: _copy(value) for module, value in statistics.items() if module in modules}


def statistics_without(everything: dict, part: dict, name: str) -> dict:
    """``{module: sum}`` of statistic ``name`` in ``everything`` less its sum in ``part``
    (both ``{name: {module: value}}``), in new tensors: the statistics of every sequence
    outside ``part``."""
    return {module: _less(value, part[name].get(module))
            for module, value in everything[name].items()}  # fmt: skip


def _copy(value):
    """A statistic's value (a float64 sum, a count, or a tuple of them: centering) in new
    tensors."""
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    return value.clone() if isinstance(value, torch.Tensor) else value


def _less(total, part):
    """``total - part`` for a statistic's value, in new tensors (``total`` itself when
    ``part`` has no entry)."""
    if part is None:
        return _copy(total)
    if isinstance(total, tuple):
        return tuple(_less(t, p) for t, p in zip(total, part, strict=True))
    if isinstance(total, torch.Tensor):
        return total - part.to(total.device)
    return total - part
