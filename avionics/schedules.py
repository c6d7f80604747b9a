"""Schedules: which steps a quantity is computed at.

A schedule is any callable ``schedule(step) -> bool``. The two built-ins match the reference
Cockpit tool exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Schedule = Callable[[int], bool]


def linear(interval: int, offset: int = 0) -> Schedule:
    """Track the steps ``offset + k * interval`` for k >= 0."""
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"linear(interval=...) needs a positive integer, got {interval!r}.")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"linear(offset=...) needs a non-negative integer, got {offset!r}.")

    def schedule(step: int) -> bool:
        return step >= offset and (step - offset) % interval == 0

    schedule.__doc__ = f"linear(interval={interval}, offset={offset})"
    return schedule


def logarithmic(
    start: float, end: float, steps: int = 300, base: float = 10, init: bool = True
) -> Schedule:
    """Track the integers of ``numpy.logspace(start, end, steps, base=base)``, plus 0 if init."""
    if end < start:
        raise ValueError(f"logarithmic needs start <= end, got start={start}, end={end}.")
    grid = np.logspace(start, end, steps, base=base).astype(int)
    tracked = set(int(s) for s in grid)
    if init:
        tracked.add(0)

    def schedule(step: int) -> bool:
        return step in tracked

    schedule.__doc__ = (
        f"logarithmic(start={start}, end={end}, steps={steps}, base={base}, init={init})"
    )
    return schedule


def describe(schedule: Schedule) -> str:
    """A one-line description of a schedule, for logs."""
    return (schedule.__doc__ or repr(schedule)).strip().splitlines()[0]
