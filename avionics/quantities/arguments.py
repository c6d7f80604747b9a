"""Checks of the quantities' constructor arguments: each refuses a bad value with an error
that names the quantity, the argument and its value, and states the valid range.

``owner`` is the quantity's (or range adaptation's) class name, ``name`` the argument's and
``meaning`` what the argument is, for the message. A TypeError means that the value is not of
the kind asked for (a bool is neither an integer nor a number here), a ValueError that it is
out of range.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

# Seeds of the quantities' private generators stay below this, so that a seed combined with
# the step number (the MC curvature diagonal's seed * 1_000_003 + step) is a valid torch seed.
SEED_LIMIT = 2**32


def checked_int(owner: str, name: str, value, minimum: int, meaning: str) -> int:
    """``value`` as an int, when it is an integer >= ``minimum``."""
    valid = f"an integer >= {minimum} ({meaning})"
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be {valid}.")
    if value < minimum:
        raise ValueError(f"{owner}({name}={value!r}): {name} must be {valid}.")
    return int(value)


def checked_seed(owner: str, value) -> int:
    """``value`` as an int, when it is an integer in [0, SEED_LIMIT)."""
    seed = checked_int(owner, "seed", value, 0, "the seed of the quantity's own generator")
    if seed >= SEED_LIMIT:
        raise ValueError(f"{owner}(seed={value!r}): seed must be below 2**32.")
    return seed


def checked_real(
    owner: str,
    name: str,
    value,
    meaning: str,
    *,
    at_least: float | None = None,
    above: float | None = None,
    below: float | None = None,
) -> float:
    """``value`` as a float, when it is a finite real number in the range the bounds give
    (``at_least``: >=, ``above``: >, ``below``: <; None: unbounded)."""
    bounds = [
        f"{relation} {bound}"
        for relation, bound in ((">=", at_least), (">", above), ("<", below))
        if bound is not None
    ]
    valid = f"a finite number{' ' + ' and '.join(bounds) if bounds else ''} ({meaning})"
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be {valid}.")
    inside = (
        math.isfinite(value)
        and (at_least is None or value >= at_least)
        and (above is None or value > above)
        and (below is None or value < below)
    )
    if not inside:
        raise ValueError(f"{owner}({name}={value!r}): {name} must be {valid}.")
    return float(value)
