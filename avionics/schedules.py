"""Schedules: which steps a quantity is computed at.

A schedule is any callable ``schedule(step) -> bool``. The two built-ins match the reference
Cockpit tool exactly. Their arguments are checked when the schedule is built: a wrong type
raises ``TypeError``, a value out of range ``ValueError``, each naming the argument, its value
and the valid range.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

Schedule = Callable[[int], bool]

# The grid is cast to int64 steps: its values must stay below 2**63 (exact in float64).
_STEP_LIMIT = 2.0**63


def _check_integer(call: str, value, minimum: int) -> None:
    """Raise unless ``value`` is an integer (not a bool) >= ``minimum``; ``call`` names the
    argument, e.g. ``"linear(interval=...)"``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(
            f"{call} needs an integer >= {minimum}, got {value!r} of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"{call} needs an integer >= {minimum}, got {value!r}.")


def _check_finite(call: str, value) -> None:
    """Raise unless ``value`` is a finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"{call} needs a finite real number, got {value!r} of type {type(value).__name__}."
        )
    if not math.isfinite(value):
        raise ValueError(f"{call} needs a finite real number, got {value!r}.")


def linear(interval: int, offset: int = 0) -> Schedule:
    """Track the steps ``offset + k * interval`` for k >= 0 (``interval`` >= 1, ``offset`` >=
    0, both integers)."""
    _check_integer("linear(interval=...)", interval, 1)
    _check_integer("linear(offset=...)", offset, 0)

    return _Linear(interval, offset)


def logarithmic(
    start: float, end: float, steps: int = 300, base: float = 10, init: bool = True
) -> Schedule:
    """Track the integers of ``numpy.logspace(start, end, steps, base=base)``, plus 0 if init.

    ``start <= end`` are finite, ``steps`` >= 1 is an integer, ``base`` > 1 is finite (so
    that the grid base**start ... base**end grows), base**end < 2**63 (an int64 step), and
    ``init`` is a bool.
    """
    _check_finite("logarithmic(start=...)", start)
    _check_finite("logarithmic(end=...)", end)
    _check_integer("logarithmic(steps=...)", steps, 1)
    _check_finite("logarithmic(base=...)", base)
    if not isinstance(init, bool):
        raise TypeError(
            f"logarithmic(init=...) needs True or False, got {init!r} of type "
            f"{type(init).__name__}."
        )
    if base <= 1:
        raise ValueError(
            f"logarithmic(base=...) needs a number > 1 (the grid base**start ... base**end "
            f"must grow), got {base!r}."
        )
    if end < start:
        raise ValueError(
            f"logarithmic needs start <= end, got start={start!r}, end={end!r}: swap them."
        )
    with np.errstate(all="ignore"):  # a huge grid overflows to inf or NaN: refused below
        grid = np.logspace(start, end, steps, base=base)
    if not grid.max() < _STEP_LIMIT:
        raise ValueError(
            f"logarithmic(end=...) needs base**end < 2**63 (steps are int64), got end={end!r} "
            f"with base={base!r}: choose a smaller end."
        )
    tracked = set(int(s) for s in grid.astype(int))
    if init:
        tracked.add(0)

    description = f"logarithmic(start={start}, end={end}, steps={steps}, base={base}, init={init})"
    return _Steps(frozenset(tracked), description)


@dataclass(frozen=True)
class _Linear:
    """The steps ``offset + k * interval``; a plain object, so that a quantity pickles (e.g.
    into the processes of a spawned data-parallel run)."""

    interval: int
    offset: int

    def __call__(self, step: int) -> bool:
        return step >= self.offset and (step - self.offset) % self.interval == 0

    @property
    def __doc__(self) -> str:  # what describe() shows
        return f"linear(interval={self.interval}, offset={self.offset})"


@dataclass(frozen=True)
class _Steps:
    """A fixed set of steps, described by the call that built it."""

    steps: frozenset
    description: str

    def __call__(self, step: int) -> bool:
        return step in self.steps

    @property
    def __doc__(self) -> str:
        return self.description


def describe(schedule: Schedule) -> str:
    """A one-line description of a schedule, for logs."""
    return (schedule.__doc__ or repr(schedule)).strip().splitlines()[0]
