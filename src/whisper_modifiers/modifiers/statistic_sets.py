"""Sets of a modifier's per-module statistics (``distributed.statistic_names``: dicts of
float64 sums, counts and centering terms), for ``gamma: auto``'s folds: copies, sums
over sets, and swapping them in and out. Glue; no maths here."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["copy_statistics", "restored_statistics", "sum_statistics"]


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


def sum_statistics(sets: list[dict], name: str, modules: set) -> dict:
    """``{module: sum}`` of statistic ``name`` over ``sets`` (each ``{name: {module:
    value}}``) for the entries of ``modules``, in new tensors."""
    total = {}
    for statistics in sets:
        for module, value in statistics[name].items():
            if module in modules:
                total[module] = _add(total.get(module), value)
    return total


def _add(total, value):
    """``total + value`` for a statistic's value: a float64 sum, a count, or a tuple of
    them (centering); a copy of ``value`` when ``total`` is None."""
    if isinstance(value, tuple):
        totals = total or (None,) * len(value)
        return tuple(_add(t, v) for t, v in zip(totals, value, strict=True))
    if total is None:
        return value.clone() if isinstance(value, torch.Tensor) else value
    if isinstance(value, torch.Tensor):
        return total + value.to(total.device)
    return total + value
