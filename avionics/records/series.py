"""Per-step series of a run: one float per step for every scalar quantity or metric.

Each value is read through its quantity's declared output (:mod:`avionics.quantities.outputs`):
per-parameter values reduce to their global value as declared (the root-sum-of-squares of
norms, the sum of traces); histograms and parameter copies have no scalar value.
"""

from __future__ import annotations

import numpy as np


def global_value(run, name: str, value) -> float | None:
    """The scalar value of one recorded value, or None if it has none (histogram, text)."""
    return run.output(name, value).scalar(value)


def series(run, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of ``name`` over the steps where it has a scalar value, sorted by
    step; non-finite values are kept. Empty arrays when it was never recorded."""
    points = []
    for step, values in run.steps.items():
        if name in values:
            value = global_value(run, name, values[name])
            if value is not None:
                points.append((step, value))
    points.sort()
    steps = np.array([p[0] for p in points], dtype=np.int64)
    return steps, np.array([p[1] for p in points], dtype=np.float64)


def scalar_names(run) -> list[str]:
    """The names that have a scalar value at one step at least, sorted."""
    names = set()
    for values in run.steps.values():
        names.update(k for k, v in values.items() if global_value(run, k, v) is not None)
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
