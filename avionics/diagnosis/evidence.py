"""The numbers the checks rest on: recent values, robust z-scores, learning rate, batch size."""

from __future__ import annotations

import numpy as np

from avionics.records.series import series

MAD_TO_STD = 1.4826  # the MAD of a normal distribution times this is its standard deviation


def finite_series(run, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of ``name`` at the steps where it is finite."""
    steps, values = series(run, name)
    keep = np.isfinite(values)
    return steps[keep], values[keep]


def latest_part(values: np.ndarray, fraction: float, minimum: int) -> np.ndarray:
    """The latest ``fraction`` of ``values``, at least ``minimum`` of them (or all)."""
    count = max(minimum, int(np.ceil(fraction * len(values))))
    return values[-count:]


def robust_z(values: np.ndarray, window: int, min_history: int) -> np.ndarray:
    """For every value, how many robust standard deviations it lies above the median of the
    ``window`` values before it: ``(x_i - median) / (1.4826 * MAD)``; the scale is at least
    1 % of ``|median|`` so that a flat history does not make every wiggle a spike. nan where
    fewer than ``min_history`` values precede."""
    z = np.full(len(values), np.nan)
    for i in range(min_history, len(values)):
        history = values[max(0, i - window) : i]
        median = np.median(history)
        scale = max(MAD_TO_STD * np.median(np.abs(history - median)), 0.01 * abs(median), 1e-12)
        z[i] = (values[i] - median) / scale
    return z


def optimizer(run) -> dict:
    """The optimizer description in the run's metadata (``{}`` when it has none)."""
    described = run.metadata.get("optimizer")
    return described if isinstance(described, dict) else {}


def hyperparameter(run, key: str):
    """``key`` of the optimizer's first parameter group in the metadata, or None."""
    groups = optimizer(run).get("param_groups") or [{}]
    return groups[0].get(key) if isinstance(groups[0], dict) else None


def learning_rate_at(run, steps: np.ndarray) -> np.ndarray:
    """The learning rate at each of ``steps``: the latest ``learning_rate`` logged at or
    before it (the first logged one before any), else the optimizer's from the metadata;
    nan where neither is known."""
    logged_steps, logged = finite_series(run, "learning_rate")
    if len(logged_steps):
        index = np.searchsorted(logged_steps, steps, side="right") - 1
        return logged[np.clip(index, 0, None)]
    lr = hyperparameter(run, "lr")
    return np.full(len(steps), float(lr) if isinstance(lr, (int, float)) else np.nan)


def batch_size(run) -> int | None:
    """The batch size: the latest ``batch_size`` recorded at a step, else the metadata's."""
    _, logged = finite_series(run, "batch_size")
    if len(logged):
        return int(logged[-1])
    size = run.metadata.get("batch_size")
    return int(size) if isinstance(size, (int, float)) else None
