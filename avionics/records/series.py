"""Per-step series of a run: one float per step for every scalar quantity or metric.

Per-parameter quantities are reduced to their global value: the root-sum-of-squares of the
per-parameter norms (GradNorm, Distance, UpdateSize) and the sum of the per-parameter traces
(HessTrace). Histograms and parameter copies have no scalar value.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np

NORM_QUANTITIES = ("GradNorm", "Distance", "UpdateSize")
SUM_QUANTITIES = ("HessTrace",)


def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def global_value(name: str, value) -> float | None:
    """The scalar value of one recorded value, or None if it has none (histogram, text)."""
    if _is_number(value):
        return float(value)
    if isinstance(value, list) and value and all(_is_number(v) for v in value):
        if name in SUM_QUANTITIES:
            return float(math.fsum(value))
        if name in NORM_QUANTITIES:
            return math.sqrt(math.fsum(float(v) ** 2 for v in value))
    return None


def series(run, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of ``name`` over the steps where it has a scalar value, sorted by
    step; non-finite values are kept. Empty arrays when it was never recorded."""
    points = []
    for step, values in run.steps.items():
        if name in values:
            value = global_value(name, values[name])
            if value is not None:
                points.append((step, value))
    points.sort()
    steps = np.array([p[0] for p in points], dtype=np.int64)
    return steps, np.array([p[1] for p in points], dtype=np.float64)


def scalar_names(run) -> list[str]:
    """The names that have a scalar value at one step at least, sorted."""
    names = set()
    for values in run.steps.values():
        names.update(k for k, v in values.items() if global_value(k, v) is not None)
    return sorted(names)


def latest(run, name: str):
    """``(step, value)`` of the last step that recorded ``name``, or ``(None, None)``."""
    for step in reversed(run.steps):
        if name in run.steps[step]:
            return step, run.steps[step][name]
    return None, None


def parameter_histograms(hist2d: dict) -> list[dict]:
    """The per-parameter histograms of a GradHist2d value as ``{"hist", "edges"}`` dicts;
    entries stored as bare count matrices share the global histogram's edges."""
    return [
        entry if isinstance(entry, dict) else {"hist": entry, "edges": hist2d["edges"]}
        for entry in hist2d.get("param_hist", [])
    ]
